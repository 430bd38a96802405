"""The Trainer on an FSDP2 runner over 2 CPU ranks (gloo, spawned as torchrun would): the same weights as one
rank, and a sharded save/resume that equals never stopping."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.trainer import Trainer
from node.trainer.config import TrainerConfig
from node.trainer.distributed import assign_micro_batches, decode_samples, encode_samples, run_ranks
from node.trainer.model import build_tiny_model_dir
from node.trainer.packing import TrainSample
from tests.unit.test_trainer_step import make_groups, train_batches

# Small micro-batches: each step is several micro-batches, split unevenly between the ranks.
CFG = TrainerConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=64, broadcast_dtype="float32")
STEPS = 3


def _batches() -> list[list]:
    return [make_groups(3, seed=200 + i) for i in range(STEPS)]


def _job(model_dir: str, out_dir: str, mode: str):
    """One rank of a run. straight: 3 steps, saving after step 2; resume*: from that save, step 3."""
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group, serve_follower

    rank, _ = init_process_group(threads=1)
    try:
        if rank != 0:
            serve_follower()
            return None
        out = Path(out_dir)
        batches = _batches()
        if mode == "straight":
            t = Trainer(model_dir, CFG, batch_prompts=3, state_dir=out / "state", runner=FSDPRunner)
            metrics = train_batches(t, batches[:2])
            t.save_state()
            metrics += train_batches(t, batches[2:])
        else:
            t = Trainer.resume(out / "state", CFG, batch_prompts=3, runner=FSDPRunner)
            assert t.step_count == 2
            metrics = train_batches(t, batches[2:])
        save_file(t.weights_for_broadcast(), str(out / f"{mode}.safetensors"))
        t.close()
        return [{k: m[k] for k in ("loss", "grad_norm", "loss_tokens", "step")} for m in metrics]
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, layers=2, heads=4, seed=11)


@pytest.fixture(scope="module")
def straight(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    metrics = run_ranks(2, _job, str(model_dir), str(out), "straight", timeout=300)[0]
    return out, metrics


@pytest.mark.slow  # spawns ranks: 20-60 s on 2 idle cores, minutes on a loaded machine
def test_two_ranks_equal_one_rank(model_dir, straight):
    out, metrics = straight
    ref_metrics = _equals_the_local_runner(model_dir, out / "straight.safetensors", metrics, "cpu", atol=1e-5, rel=1e-5)
    for m, r in zip(metrics, ref_metrics):
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


def _equals_the_local_runner(model_dir, weights: Path, metrics: list[dict], device: str, *, atol: float,
                             rel: float) -> list[dict]:
    """The FSDP run's weights and per-step metrics against the local runner's on `device`; its metrics."""
    single = Trainer(model_dir, CFG, batch_prompts=3, device=device)
    ref_metrics = train_batches(single, _batches())
    ref = single.weights_for_broadcast()
    got = load_file(str(weights))
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=atol, rtol=0, msg=name)
    for m, r in zip(metrics, ref_metrics):
        assert m["loss_tokens"] == r["loss_tokens"] and m["step"] == r["step"]
        assert m["loss"] == pytest.approx(r["loss"], rel=rel, abs=rel / 100)
    return ref_metrics


@pytest.mark.slow  # spawns ranks: 20-60 s on 2 idle cores, minutes on a loaded machine
def test_sharded_resume_equals_never_stopping(straight):
    out, metrics = straight
    assert (out / "state" / "step-00000002" / "dcp" / ".metadata").is_file()
    resumed = run_ranks(2, _job, "", str(out), "resume", timeout=300)[0]
    a, b = load_file(str(out / "straight.safetensors")), load_file(str(out / "resume.safetensors"))
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    assert resumed[0]["loss"] == pytest.approx(metrics[2]["loss"], rel=1e-6)


@pytest.mark.slow  # spawns ranks: 20-60 s on 2 idle cores, minutes on a loaded machine
def test_two_rank_state_resumes_on_one_rank(straight):
    """torch.distributed.checkpoint reshards: the 2-rank snapshot loads into a 1-rank process group."""
    out, metrics = straight
    run_ranks(1, _job, "", str(out), "resume-1", timeout=300)
    a, b = load_file(str(out / "straight.safetensors")), load_file(str(out / "resume-1.safetensors"))
    for name in a:  # one rank sums the micro-batch gradients in another order: float rounding only
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)


def test_batch_codec_and_split():
    samples = [TrainSample([1, 2], [3], [-0.5], 0.25, None, key=(0, 1)),
               TrainSample([4], [5, 6], [-1.0, -2.0], -1.5, [-0.1, -0.2], key=(1, 0)),
               TrainSample([4], [5, 2, 7, 6], [-1.0, 0.0, 0.0, -2.0], 0.5, None, key=(1, 1),
                           loss_mask=[True, False, False, True])]  # a multi-turn episode
    assert decode_samples(*encode_samples(samples)) == samples
    share = assign_micro_batches([10, 50, 20, 30], 2)
    assert share == [[0, 1], [2, 3]]  # 50 -> r0, 30 -> r1, 20 -> r1, 10 -> r0 (tie: lower rank)
    assert assign_micro_batches([5], 3) == [[0], [], []]


def _launch_job(model_dir: str, out_dir: str):
    """The coordinator's way: this process becomes rank 0, the follower is `python -m node.trainer.distributed`."""
    from node.trainer.distributed import launch

    t = launch(2, model_dir, CFG, batch_prompts=3, state_dir=Path(out_dir) / "launched-state")
    from node.trainer.distributed import FSDPRunner

    runner = t.runner
    assert isinstance(runner, FSDPRunner)
    procs = list(runner.followers)
    try:
        assert runner.world_size == 2 and len(procs) == 1
        train_batches(t, _batches())
        weights = t.weights_for_broadcast()
    finally:
        t.close()
    assert [p.returncode for p in procs] == [0]  # the follower left on STOP
    save_file(weights, str(Path(out_dir) / "launched.safetensors"))


@pytest.mark.slow
def test_launch_starts_its_own_follower_rank(model_dir, straight):
    out, _ = straight
    run_ranks(1, _launch_job, str(model_dir), str(out), timeout=300)
    a, b = load_file(str(out / "straight.safetensors")), load_file(str(out / "launched.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def _one_rank_job(model_dir: str, out_dir: str, device: str = "cuda"):
    """One rank on CUDA over NCCL: 2 steps, a sharded save, a resume into a fresh runner, step 3 (the save and
    load go through torch.distributed.checkpoint with the shards on the GPU)."""
    from node.trainer.distributed import FSDPRunner, destroy_process_group, init_process_group

    init_process_group(device=device, threads=1)
    try:
        out = Path(out_dir)
        batches = _batches()
        t = Trainer(model_dir, CFG, batch_prompts=3, state_dir=out / "cuda-state", device=device, runner=FSDPRunner)
        metrics = train_batches(t, batches[:2])
        t.save_state()
        del t  # not closed: close() leaves the process group, which the resumed runner needs
        t = Trainer.resume(out / "cuda-state", CFG, batch_prompts=3, device=device, runner=FSDPRunner)
        assert t.step_count == 2
        metrics += train_batches(t, batches[2:])
        save_file(t.weights_for_broadcast(), str(out / "cuda-fsdp.safetensors"))
        t.close()
        return [{k: m[k] for k in ("loss", "grad_norm", "loss_tokens", "step")} for m in metrics]
    finally:
        destroy_process_group()


@pytest.mark.gpu
def test_fsdp_runner_on_cuda_over_nccl_equals_the_local_runner(model_dir, tmp_path):
    """The FSDP runner on a GPU (NCCL, one rank: the device lane lends one GPU), saved and resumed halfway,
    gives the weights and losses of the local runner on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    metrics = run_ranks(1, _one_rank_job, str(model_dir), str(tmp_path), timeout=300)[0]
    _equals_the_local_runner(model_dir, tmp_path / "cuda-fsdp.safetensors", metrics, "cuda", atol=1e-4, rel=1e-4)
