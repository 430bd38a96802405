"""trainer.lora on the FSDP2 runner over 2 CPU ranks (gloo, spawned as torchrun would; issue #29): the warm start
trains the base and RL the adapters alone, with the same losses, merged weights and published adapter as one rank
(the LocalRunner), and a sharded save/resume that equals never stopping, optimizer moments included."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.trainer import Group, Rollout, Trainer, lora
from node.trainer.config import TrainerConfig
from node.trainer.distributed import run_ranks
from node.trainer.model import build_tiny_model_dir
from tests.unit.test_trainer_step import make_groups, train_batches

# Small micro-batches: each step is several micro-batches, split unevenly between the ranks. The MLP targets too:
# the adapters of every projection are sharded with their layer.
CFG = TrainerConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=64, broadcast_dtype="float32",
                    lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]})
WARM_STEPS, STEPS = 3, 3


def _warm_batches() -> list[list[Group]]:
    """Reference answers as node/trainer/warm_start.py builds them (one rollout per group, advantage 0), the same
    batch each step: its NLL falls."""
    batch = [Group(g.prompt_id, g.prompt_ids, [Rollout(r.completion_ids, [0.0] * len(r.completion_ids), 1.0)
                                              for r in g.rollouts[:1]], [0.0]) for g in make_groups(3, seed=70)]
    return [batch] * WARM_STEPS


def _batches() -> list[list]:
    return [make_groups(3, seed=400 + i) for i in range(STEPS)]


def _views(t: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The base and the adapter (plain names) of the model the trainer evaluates: rank 0's gathered copy on an
    FSDPRunner, the model itself on one rank."""
    m = t.full_model()
    return {"base": {k: v.detach().clone() for k, v in lora.base_state_dict(m).items()},
            "adapter": {k: v.detach().clone() for k, v in lora.plain_adapter(m).items()}}


def _flat(views: dict[str, dict[str, torch.Tensor]], prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{kind}/{n}": t.contiguous() for kind, d in views.items() for n, t in d.items()}


def _run(t: Trainer, out: Path | None) -> tuple[dict[str, torch.Tensor], list[float], list[dict]]:
    """init -> warm start -> RL steps 1, 2 (saved when `out`) -> step 3: the views after each phase, the published
    weights and adapter; the warm start's NLLs and the RL metrics."""
    tensors = _flat(_views(t), "init")
    nll = t.sft(_warm_batches(), lr=1e-2)
    tensors |= _flat(_views(t), "warm")
    metrics = train_batches(t, _batches()[:2])
    if out is not None:
        t.save_state()
        save_file(_moments(t), str(out / "moments-straight.safetensors"))  # rank 0's shards, as saved
    metrics += train_batches(t, _batches()[2:])
    tensors |= _flat(_views(t), "rl")
    tensors |= {f"published/{k}": v for k, v in t.weights_for_broadcast().items()}
    adapter = t.adapter_for_broadcast()
    assert adapter is not None and (adapter.rank, adapter.alpha) == (4, 8)
    tensors |= {f"adapter/{k}": v for k, v in adapter.tensors.items()}
    return tensors, nll, [{k: m[k] for k in ("loss", "grad_norm", "loss_tokens", "step")} for m in metrics]


def _moments(t: Trainer) -> dict[str, torch.Tensor]:
    """This rank's shards of the RL optimizer's state, by parameter index."""
    from torch.distributed.tensor import DTensor

    out = {}
    params = [p for g in t.optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in t.optimizer.state.get(p, {}).items():
            out[f"{i}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone().reshape(-1)
    return out


def _job(model_dir: str, out_dir: str, mode: str):
    """One rank. straight: _run, saving after RL step 2; resume: from that save, RL step 3."""
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group, serve_follower

    rank, _ = init_process_group(threads=1)
    try:
        if rank != 0:
            serve_follower()
            return None
        out = Path(out_dir)
        if mode == "straight":
            t = Trainer(model_dir, CFG, batch_prompts=3, state_dir=out / "state", runner=FSDPRunner)
            # only the adapters are in the RL optimizer, and only they require a gradient outside the warm start
            optimized = [p for g in t.optimizer.param_groups for p in g["params"]]
            trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
            assert len(optimized) == len(trainable) == 2 * 4 * 2 and all(".lora_" in n for n in trainable), trainable
            tensors, nll, metrics = _run(t, out)
        else:
            t = Trainer.resume(out / "state", CFG, batch_prompts=3, runner=FSDPRunner)
            assert t.step_count == 2
            save_file(_moments(t), str(out / "moments-resumed.safetensors"))
            metrics = train_batches(t, _batches()[2:])
            nll = []
            tensors = {f"published/{k}": v for k, v in t.weights_for_broadcast().items()}
            adapter = t.adapter_for_broadcast()
            assert adapter is not None
            tensors |= {f"adapter/{k}": v for k, v in adapter.tensors.items()}
            metrics = [{k: m[k] for k in ("loss", "grad_norm", "loss_tokens", "step")} for m in metrics]
        save_file(tensors, str(out / f"{mode}.safetensors"))
        t.close()
        return nll, metrics
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=11)


@pytest.fixture(scope="module")
def straight(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-lora")
    nll, metrics = run_ranks(2, _job, str(model_dir), str(out), "straight", timeout=300)[0]
    return out, nll, metrics


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    t = Trainer(model_dir, CFG, batch_prompts=3)
    return _run(t, None)


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], prefix: str, atol: float) -> None:
    names = [n for n in ref if n.startswith(prefix)]
    assert names and {n for n in got if n.startswith(prefix)} == set(names), prefix
    for n in names:
        torch.testing.assert_close(got[n], ref[n], atol=atol, rtol=0, msg=n)


@pytest.mark.slow  # spawns ranks: 20-60 s on 2 idle cores, minutes on a loaded machine
def test_two_ranks_lora_equal_one_rank_lora(straight, one_rank):
    out, nll, metrics = straight
    ref, ref_nll, ref_metrics = one_rank
    got = load_file(str(out / "straight.safetensors"))
    assert nll == pytest.approx(ref_nll, rel=1e-5)
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert m["loss_tokens"] == r["loss_tokens"] and m["step"] == r["step"]
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    for phase in ("init", "warm", "rl"):  # the same adapters' init, warm-started base and trained adapters
        _close(got, ref, f"{phase}/", 1e-5)
    _close(got, ref, "published/", 1e-5)  # the merged weights step 0 / verification use
    _close(got, ref, "adapter/", 1e-5)  # the factors a lora-adapter checkpoint carries


@pytest.mark.slow
def test_the_warm_start_moves_the_base_and_rl_the_adapters_only(straight):
    out, nll, _ = straight
    got = load_file(str(out / "straight.safetensors"))

    def part(phase, kind):
        return {n.split("/", 2)[2]: t for n, t in got.items() if n.startswith(f"{phase}/{kind}/")}

    assert nll[-1] < nll[0], nll
    init_b, warm_b, rl_b = part("init", "base"), part("warm", "base"), part("rl", "base")
    init_a, warm_a, rl_a = part("init", "adapter"), part("warm", "adapter"), part("rl", "adapter")
    assert not all(torch.equal(warm_b[n], init_b[n]) for n in init_b)  # the warm start trained the base
    assert all(torch.equal(warm_a[n], init_a[n]) for n in init_a)  # and left the adapters at init
    assert not any(t.any() for n, t in warm_a.items() if n.endswith(".lora_B"))
    assert all(torch.equal(rl_b[n], warm_b[n]) for n in warm_b)  # RL: the base bit-identical
    assert all(not torch.equal(rl_a[n], warm_a[n]) for n in warm_a), "an adapter factor did not move in RL"


@pytest.mark.slow
def test_sharded_lora_resume_equals_never_stopping(straight):
    out, _, metrics = straight
    snap = out / "state" / "step-00000002"
    assert (snap / "dcp" / ".metadata").is_file()
    _, resumed = run_ranks(2, _job, "", str(out), "resume", timeout=300)[0]
    a, b = load_file(str(out / "moments-straight.safetensors")), load_file(str(out / "moments-resumed.safetensors"))
    assert set(a) == set(b) and len(a) == 3 * 2 * 4 * 2  # (exp_avg, exp_avg_sq, step) of the 16 adapter factors
    for n in a:  # came back bit-identical, shard by shard
        assert torch.equal(a[n], b[n]), n
    straight_w, resumed_w = load_file(str(out / "straight.safetensors")), load_file(str(out / "resume.safetensors"))
    _close(resumed_w, straight_w, "published/", 1e-6)
    _close(resumed_w, straight_w, "adapter/", 1e-6)
    assert resumed[0]["loss"] == pytest.approx(metrics[2]["loss"], rel=1e-6)
    assert resumed[0]["grad_norm"] == pytest.approx(metrics[2]["grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_a_sharded_lora_snapshot_refuses_another_lora_config(straight):
    out, _, _ = straight
    for other in (CFG.model_copy(update={"lora": CFG.lora.model_copy(update={"rank": 8})}),
                  CFG.model_copy(update={"lora": CFG.lora.model_copy(update={"rank": 0})})):
        with pytest.raises(RuntimeError, match="trainer.lora"):
            run_ranks(1, _resume_with, str(out / "state"), other, timeout=300)


def _resume_with(state_dir: str, cfg: TrainerConfig):
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group

    init_process_group(threads=1)
    try:
        Trainer.resume(state_dir, cfg, batch_prompts=3, runner=FSDPRunner).close()
    finally:
        destroy_process_group()


def _phi_dir(llama_dir: Path, out: Path) -> Path:
    """A tiny Phi model (attention output `dense`, MLP fc1 / fc2: no o_proj, gate_proj, up_proj, down_proj) with
    the Llama directory's tokenizer."""
    from transformers import PhiConfig, PhiForCausalLM

    out.mkdir(parents=True)
    for f in llama_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    cfg = json.loads((llama_dir / "config.json").read_text())
    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=cfg["vocab_size"], hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                     bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                                     pad_token_id=cfg.get("pad_token_id")))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _build_job(model_dir: str, cfg: TrainerConfig):
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group, serve_follower

    rank, _ = init_process_group(threads=1)
    try:
        if rank != 0:
            serve_follower()
            return None
        Trainer(model_dir, cfg, batch_prompts=3, runner=FSDPRunner).close()
    finally:
        destroy_process_group()


@pytest.mark.slow
def test_lora_targets_the_model_lacks_fail_clearly_on_two_ranks(model_dir, tmp_path):
    phi = _phi_dir(Path(model_dir), tmp_path / "phi")
    cfg = CFG.model_copy(update={"lora": CFG.lora.model_copy(update={"target_modules": ["q_proj", "o_proj"]})})
    with pytest.raises(RuntimeError, match=r"trainer.lora.target_modules: the model has no module named \['o_proj'\]"):
        run_ranks(2, _build_job, str(phi), cfg, timeout=300)
