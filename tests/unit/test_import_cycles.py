"""No import cycles in protocol/, verify/ and node/ (issue #28, item 4), beside the layering test
(tests/unit/test_layers.py), whose list of modules it uses.

The graph is read from the source (AST), not from an import: an edge A -> B for every import statement in A
that names project module B. `from P import x` is an edge to the submodule P.x when there is one, else to P.
What counts:
- module-level imports and imports inside functions and methods alike: a function-level import is the usual
  way to hide a cycle (it defers the failure to the first call, it does not remove the dependency);
- not the imports under `if TYPE_CHECKING:`: they never run, so they cannot leave a module half-initialised
  or order one module's loading before another; they are annotations naming a caller (node.p2p.nat's
  NatKeeper is typed with the P2PNode that drives it);
- not modules loaded by name at run time (node.trainer's lazy `__getattr__` table): there is no import
  statement to read, and the package itself is imported by none of its submodules.
"""
import ast
from collections import deque
from pathlib import Path

from tests.unit.test_layers import REPO, from_module, project_modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:` blocks (not their else)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(
                (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
                or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING") for t in ast.walk(node.test)):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def import_graph(modules) -> dict[str, dict[str, tuple[Path, int]]]:
    """module -> {imported project module: (file, line of the first such import)}."""
    known = {m: (path, is_package) for m, path, is_package in modules}
    graph: dict[str, dict[str, tuple[Path, int]]] = {m: {} for m in known}
    for module, (path, is_package) in known.items():
        package = module if is_package else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                source = from_module(package, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in known else source)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in known and target != module:
                    graph[module].setdefault(target, (path, node.lineno))
    return graph


def _components(graph: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative) with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _shortest_cycle(graph: dict[str, dict], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {component}")  # a component always has one


def describe_cycles(graph: dict[str, dict]) -> list[str]:
    """One line per cycle: each import on it with its file and line."""
    lines = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            path, line = graph[a][b]
            steps.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line} {a} imports {b}")
        lines.append(" -> ".join(steps))
    return lines


def test_no_import_cycles_in_the_project():
    cycles = describe_cycles(import_graph(project_modules()))
    assert not cycles, "import cycles (move what both need to the module that owns it):\n" + "\n".join(cycles)


def _tree(tmp_path: Path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path in sorted(tmp_path.rglob("*.py")):
        parts = path.relative_to(tmp_path).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), path, is_package


def test_a_cycle_hidden_in_a_function_is_found_and_a_type_only_one_is_not(tmp_path):
    graph = import_graph(list(_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g\n",  # the hidden half of the cycle
        "pkg/b.py": "from . import a\n\ndef g():\n    return a\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n",
        "pkg/d.py": "from pkg.c import *\nclass D: ...\n",
    })))
    [cycle] = describe_cycles(graph)
    assert "pkg.a imports pkg.b" in cycle and "pkg.b imports pkg.a" in cycle and "a.py:2" in cycle
    assert "pkg.d" not in graph["pkg.c"] and "pkg.c" in graph["pkg.d"]
