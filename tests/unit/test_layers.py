"""Data flows one way (docs/ARCHITECTURE.md, "Layers"): no module imports from a layer above it.

Every import statement counts, function-local ones too (the lazy imports of torch or libp2p are of other
packages and do not matter here). A module belongs to the longest prefix listed in LAYERS; it may import
its own layer and the layers below it.
"""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, ...]] = [
    ("protocol",),
    ("verify",),
    # shared by several roles, so beside the roles and below all of them; the roles' config sections are
    # plain pydantic models that import nothing of the roles
    ("node.aio", "node.backoff", "node.fdlimits", "node.lifecycle", "node.logs", "node.rate_limit", "node.peer_log",
     "node.plugins", "node.real_model", "node.model_loading",
     "node.http",
     "node.checkpoint_dir", "node.checkpoint_routes",
     "node.p2p.config", "node.trainer.config", "node.worker.config",
     "node.p2p.addrs"),  # pure address rules (ipaddress only): node.p2p.config checks p2p.relay_addrs with them
    ("node.config",),
    ("node.envs",),
    ("node.trainer",),
    ("node.p2p",),  # imports neither worker nor coordinator
    ("node.worker",),
    ("node.relay",),  # a fetcher without an engine: the worker's fetcher and the shared routes
    ("node.verifier",),  # the worker's fetcher, client and engine loader; the coordinator never imports it
    ("node.coordinator",),
    ("node.demo", "node.cli", "node.checkpoint_cli", "node"),
]


def layer_of(module: str) -> int | None:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else best[0]


def project_modules():
    for top in ("protocol", "verify", "node"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                yield ".".join(parts[:-1]), path, True
            else:
                yield ".".join(parts), path, False


def from_module(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement in `package` reads from (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, is_package: bool):
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, from_module(package, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_every_project_module_has_a_layer():
    missing = [m for m, _, _ in project_modules() if layer_of(m) is None]
    assert not missing, missing


def test_no_module_imports_from_a_layer_above_it():
    uphill = []
    for module, path, is_package in project_modules():
        own = layer_of(module)
        for line, target in imports_of(module, path, is_package):
            if target.split(".")[0] not in ("protocol", "verify", "node"):
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                uphill.append(f"{path.relative_to(REPO)}:{line} ({module}) imports {target}")
    assert not uphill, "\n".join(uphill)
