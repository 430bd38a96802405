"""The trainer by composition (issue #28, item 4): one Trainer class, which holds a model runner (a LocalRunner
or an FSDPRunner, node/trainer/runner.py); nothing subclasses Trainer, nothing outside trainer.py reaches into
a trainer's private members, and the same Trainer drives either runner to the same weights."""
from __future__ import annotations

import ast

import pytest
import torch

from node.trainer import Group, Rollout, Trainer
from node.trainer.config import TrainerConfig
from node.trainer.model import build_tiny_model_dir
from node.trainer.state import TrainerStateError
from tests.unit.test_layers import REPO
from tests.unit.test_trainer_step import make_groups

SOURCES = sorted(p for d in ("node", "bench") for p in (REPO / d).rglob("*.py"))


def _name_of(node: ast.expr) -> str:
    """`a.b.c` for a Name/Attribute chain, '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name_of(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def test_nothing_subclasses_trainer():
    """The FSDP trainer used to be `DistributedTrainer(Trainer)`, overriding a method Trainer.__init__ calls
    (so it needed `_ready`/`_sharded` flags). What differs between the two is the runner's."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [_name_of(b) for b in node.bases]
                if any(b == "Trainer" or b.endswith(".Trainer") for b in bases):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} class {node.name}({', '.join(bases)})")
    assert not found, "Trainer is composed with a model runner, not subclassed:\n" + "\n".join(found)


def private_trainer_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, `owner._member`) for each private member read or written on something named trainer/Trainer."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = _name_of(node.value)
            if owner.split(".")[-1] in ("trainer", "Trainer"):
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return found


def test_no_module_reaches_into_a_trainers_private_members():
    """`trainer._x`, `self.trainer._x` from outside node/trainer/trainer.py: the warm start, the snapshot code
    and the FSDP launcher use the Trainer's public methods (the old state.py called `trainer._enqueue`, the old
    launcher set `trainer._followers`)."""
    found = [f"{path.relative_to(REPO)}:{line} {use}" for path in SOURCES
             if path != REPO / "node" / "trainer" / "trainer.py"
             for line, use in private_trainer_uses(ast.parse(path.read_text(), str(path)))]
    assert not found, "private members of a Trainer used outside trainer.py:\n" + "\n".join(found)


def test_the_private_member_check_sees_the_old_patterns():
    """The check above is not vacuous: the lines the old code had are found, public calls are not."""
    old = "def f(trainer, self):\n    trainer._enqueue(1)\n    self.trainer._win['x'] = 0\n    trainer.sft([])\n"
    assert private_trainer_uses(ast.parse(old)) == [(2, "trainer._enqueue"), (3, "self.trainer._win")]


def test_each_snapshot_format_is_defined_once():
    """FORMAT (LocalRunner's, node/trainer/state.py) and FSDP_FORMAT (node/trainer/distributed_state.py): one
    assignment each in the project; everything else imports them."""
    where: dict[str, list[str]] = {"FORMAT": [], "FSDP_FORMAT": []}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in where:
                    where[t.id].append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert [w.split(":")[0] for w in where["FORMAT"]] == ["node/trainer/state.py"], where
    assert [w.split(":")[0] for w in where["FSDP_FORMAT"]] == ["node/trainer/distributed_state.py"], where


# ------------------------------------------------------------------ one Trainer, two runners

CFG = TrainerConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=64, broadcast_dtype="float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=13)


def _sft_groups() -> list[Group]:
    return [Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [0.0] * len(r.completion_ids), 1.0)
                                              for r in g.rollouts[:1]], [0.0]) for g in make_groups(2, seed=21)]


def _run(trainer: Trainer, steps: range) -> list[dict]:
    out = []
    for i in steps:
        for g in make_groups(2, seed=400 + i):
            trainer.add_group(g)
        out.append(trainer.step())
    return out


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process (the FSDPRunner's collectives on one rank)."""
    from node.trainer.distributed import destroy_process_group, free_port, init_process_group

    init_process_group(rank=0, world_size=1, port=free_port(), threads=torch.get_num_threads())
    try:
        yield
    finally:
        destroy_process_group()


def test_the_same_trainer_on_a_local_and_an_fsdp_runner(model_dir, tmp_path, one_rank_group):
    """Warm start (a second optimizer), RL steps, a snapshot and a resume, driven through the same Trainer
    methods: the FSDP runner on one rank reaches the local runner's weights (float rounding: the gradient norm
    is summed another way), and each runner refuses the other's snapshots."""
    from node.trainer.distributed import FSDPRunner
    from node.trainer.runner import LocalRunner

    trainers = {"local": Trainer(model_dir, CFG, batch_prompts=2, state_dir=tmp_path / "local"),
                "fsdp": Trainer(model_dir, CFG, batch_prompts=2, state_dir=tmp_path / "fsdp", runner=FSDPRunner)}
    assert isinstance(trainers["local"].runner, LocalRunner) and isinstance(trainers["fsdp"].runner, FSDPRunner)
    nll = {k: t.sft([_sft_groups()] * 3, lr=1e-2) for k, t in trainers.items()}
    assert nll["fsdp"] == pytest.approx(nll["local"], rel=1e-5) and nll["local"][-1] < nll["local"][0]
    metrics = {k: _run(t, range(2)) for k, t in trainers.items()}
    for k, t in trainers.items():
        t.save_state()
    resumed = {"local": Trainer.resume(tmp_path / "local", CFG, batch_prompts=2),
               "fsdp": Trainer.resume(tmp_path / "fsdp", CFG, batch_prompts=2, runner=FSDPRunner)}
    for k, t in resumed.items():
        assert t.step_count == 2
        metrics[k] += _run(t, range(2, 3))
    for m, r in zip(metrics["fsdp"], metrics["local"]):
        assert m["loss_tokens"] == r["loss_tokens"] and m["step"] == r["step"]
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    a, b = resumed["local"].weights_for_broadcast(), resumed["fsdp"].weights_for_broadcast()
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)
    full = resumed["fsdp"].full_model()  # evaluation's unsharded copy holds the same weights
    assert full is not resumed["fsdp"].model
    torch.testing.assert_close(full.state_dict()["model.norm.weight"], b["model.norm.weight"], atol=0, rtol=0)
    assert resumed["local"].full_model() is resumed["local"].model
    with pytest.raises(TrainerStateError, match="not a sharded"):
        Trainer.resume(tmp_path / "local", CFG, batch_prompts=2, runner=FSDPRunner)
    with pytest.raises(TrainerStateError, match="not a prime-node trainer state"):
        Trainer.resume(tmp_path / "fsdp", CFG, batch_prompts=2)


def test_the_fsdp_runner_needs_a_process_group(model_dir):
    from node.trainer.distributed import FSDPRunner
    from node.trainer.trainer import TrainerError

    with pytest.raises(TrainerError, match="process group"):
        Trainer(model_dir, CFG, runner=FSDPRunner)

