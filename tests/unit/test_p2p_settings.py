"""The p2p settings are written once (#28 item 5): a field of P2PConfig (node/p2p/config.py) plus where it is used.
The host (P2PNode), its trio side (P2PService) and the relay (nat.Relaying) take the P2PConfig whole, so

- every field is read somewhere in node/ through a config object (`cfg.x`, `self.cfg.x`, `cfg.p2p.x`,
  `self.p2p_cfg.x`): a field nobody reads is a setting that does nothing;
- no constructor on the settings path has a parameter named after a field, no class in node/p2p declares one as
  an annotated attribute (as the old ServiceSettings dataclass did), and the host's classes copy none
  onto themselves (`self.x = ...`): a copy is a second place to keep in step.

Pure source and signature checks: no host is started."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from node.p2p.config import P2PConfig

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "node"
CONFIG = NODE / "p2p" / "config.py"
FIELDS = frozenset(P2PConfig.model_fields)
# An attribute read through one of these is a config read: cfg / self.cfg / self.p2p_cfg / cfg.p2p / self.cfg.p2p /
# self.p2p.cfg (the worker's host's copy). `self.p2p.x` alone is the host object, not its config.
CONFIG_BASE = re.compile(r"(?:^|\.)(?:cfg|p2p_cfg)(?:\.p2p)?$")
# The settings path: classes that take the P2PConfig whole and must not re-list or copy its fields.
HOST_CLASSES = {"host.py": {"P2PNode"}, "service.py": {"P2PService"}, "nat.py": {"Relaying"}}
# `P2PNode.announce_addrs` is what the node announces now (the dial-back and relay circuits change it), not the
# `announce_addrs` setting (the operator's addresses, read from cfg).
RUNTIME_NAMESAKES = {"announce_addrs"}


def config_reads(trees) -> set[str]:
    """Attribute names read through a config object (CONFIG_BASE) anywhere in `trees`."""
    return {n.attr for tree in trees for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and CONFIG_BASE.search(ast.unparse(n.value))}


def parsed(paths) -> list[ast.Module]:
    return [ast.parse(p.read_text(), str(p)) for p in paths]


def self_assigned(cls: ast.ClassDef) -> set[str]:
    """Names a class assigns on `self` anywhere in its body (`self.x = ...`, `self.x, self.y = ...`, `self.x: T`)."""
    targets = [t for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return {t.attr for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}


def node_sources() -> list[Path]:
    return [p for p in NODE.rglob("*.py") if p != CONFIG]


def test_every_p2p_setting_is_read_where_it_is_used():
    reads = config_reads(parsed(node_sources()))
    unread = sorted(FIELDS - reads)
    assert not unread, (f"P2PConfig fields nothing in node/ reads through a config object: {unread}; a setting "
                        "must be read where it takes effect (P2PNode gets the config whole: read self.cfg.<field>)")


def test_the_read_check_sees_what_it_should():
    """The check above is not vacuous: the host's own reads are found, a made-up field is not, and reading the
    host object (`self.p2p.x`) does not count as reading its config."""
    host_reads = config_reads(parsed([NODE / "p2p" / "host.py"]))
    assert {"listen", "listen_host", "listen_port", "bootstrap", "announce_addrs", "dial_retry_s", "http"} <= host_reads
    assert "no_such_setting" not in config_reads(parsed(node_sources()))
    probe = ast.parse("self.p2p.announce_addrs\nself.p2p.cfg.allow_private_addrs\ncfg.p2p.enabled\nx.cfgs.http")
    assert config_reads([probe]) == {"allow_private_addrs", "enabled", "p2p"}  # p2p: the section of cfg


def test_no_constructor_on_the_settings_path_re_lists_a_setting():
    from node.p2p.host import P2PNode
    from node.p2p.nat import Relaying
    from node.p2p.service import P2PService

    for cls in (P2PNode, P2PService, Relaying):
        params = set(inspect.signature(cls.__init__).parameters)
        assert "cfg" in params, f"{cls.__name__} takes the P2PConfig whole (a `cfg` parameter)"
        assert not params & FIELDS, f"{cls.__name__}.__init__ re-lists P2PConfig fields: {sorted(params & FIELDS)}"


def test_no_p2p_class_declares_or_copies_a_setting():
    for path in sorted((NODE / "p2p").glob("*.py")):
        if path == CONFIG:
            continue
        for cls in (n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)):
            declared = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            assert not declared & FIELDS, f"{path.name}: class {cls.name} declares P2PConfig fields {declared & FIELDS}"
            if cls.name not in HOST_CLASSES.get(path.name, ()):
                continue
            copied = (self_assigned(cls) & FIELDS) - RUNTIME_NAMESAKES
            assert not copied, (f"{path.name}: {cls.name} copies P2PConfig fields onto itself: {sorted(copied)} "
                                "(read self.cfg.<field> where it is used)")
    assert set().union(*HOST_CLASSES.values()) == {"P2PNode", "P2PService", "Relaying"}


def test_the_copy_check_would_catch_the_old_host():
    """What the copy check flags: the host as it was before the config was passed whole (a sample of it)."""
    old = ast.parse("class P2PNode:\n    def __init__(self, upload_limit):\n        self.upload_limit = upload_limit\n"
                    "        self.dial_timeout_s, self.x = 3.0, 1\n        other.http = True\n")
    [cls] = [n for n in ast.walk(old) if isinstance(n, ast.ClassDef)]
    assert self_assigned(cls) & FIELDS == {"upload_limit", "dial_timeout_s"}
