"""FSDP2 data-parallel training: the model runner on N local ranks, gradients equal to one rank's.

Who does what
-------------
Rank 0 is the coordinator's process. Its `Trainer` (node/trainer/trainer.py, the same class as on one
rank) holds an `FSDPRunner` instead of a `LocalRunner` (node/trainer/runner.py): groups are offered to the
Trainer (`add_group`: advantages, filters, pools, keep rate -- all rank-0 state), and the runner's calls
that touch the model become collective commands that rank 0 broadcasts and every rank executes together:

    FB      forward/backward on a list of samples                   (forward_backward)
    APPLY   divide by the batch's loss tokens, clip, optimizer step, zero grads  (step)
    NEW_OPTIMIZER  a second AdamW on every rank (the SFT warm start's)  (new_optimizer)
    GATHER  full (unsharded) state dict for the broadcast checkpoint  (weights_for_broadcast),
            or for evaluation on rank 0's unsharded copy of the model  (full_model)
    GATHER_ADAPTER  the LoRA factors alone, unsharded, for a `lora-adapter` checkpoint  (adapter_for_broadcast)
    SCOPE   enter / leave the warm start's scope: with trainer.lora the base trains, the adapters wait  (warm_start_scope)
    SAVE / LOAD  sharded model + optimizer with torch.distributed.checkpoint  (write_weights / load_snapshot)

Ranks 1..N-1 are followers (`python -m node.trainer.distributed`, or `serve_follower()` inside a process
whose process group is up): they build the same runner from the init message rank 0 broadcasts, then loop
on commands until STOP. A command is a header tensor plus int64 / float64 / uint8 payload tensors
(`encode_samples`): no pickle crosses between ranks, and the followers never see network input --
only samples rank 0 built from verified, already-selected groups.

Gradients = the single-rank step
--------------------------------
Every rank packs the batch's samples into the same micro-batches (`build_micro_batches` is
deterministic) and takes its share (greedy balance by padded tokens). Each back-propagates the SUM of
its per-token losses; FSDP's reduce-scatter SUMS across ranks (gradient divide factor 1); APPLY then
divides by the batch's loss-token count, all-reduced over the ranks -- exactly the single-rank
normalisation (trainer.py's docstring). Ranks with fewer micro-batches run zero-weighted dummy passes so
every rank issues the same collectives. Only the summation order differs: weights match the
single-rank run to float32 rounding (tests/unit/test_fsdp_trainer.py: 1e-5 after 3 steps).

Trainer state (sharded): STATE_DIR/LATEST and STATE_DIR/step-NNNNNNNN/ as in node.trainer.state, with
`dcp/` (model + optimizer through torch.distributed.checkpoint, one file per rank: resumable on any
number of ranks), `model/` (config + tokenizer, no weights), rng.safetensors and trainer.json
(format distributed_state.FSDP_FORMAT). The LocalRunner keeps its own safetensors format (see the report in
issue #15): DCP's `.metadata` file is a pickle, which the single-rank format avoids on purpose.

With trainer.lora (node/trainer/lora.py) every rank wraps the model with peft's LoRA before sharding it (the
same seed: the same adapters' init as one rank), so a decoder layer's shard holds its base weights (frozen) and its
adapters (trained); the optimizers hold the trainable shards only. What rank 0 publishes and evaluates comes from
a plain peft model on its CPU loaded with the gathered state (`_host_model`): the merged weights and the adapter
under the base names by the LocalRunner's own code (runner.broadcast_state, lora.adapter_for_broadcast). The
snapshot's trainer.json records trainer.lora, and a resume with another one is refused (lora.check_snapshot).

All ranks live on one machine (MASTER_ADDR 127.0.0.1): gloo on CPU, NCCL with one GPU per rank.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, cast

import torch
import torch.distributed as dist

from node.trainer import lora
from node.trainer.config import TrainerConfig
from node.trainer.distributed_state import FSDP_FORMAT, base_model_dir
from node.trainer.loss import resolve_loss, sft_loss
from node.trainer.packing import MicroBatch, TrainSample, build_micro_batches
from node.trainer.runner import (
    TOKEN_WEIGHTED,
    LossFn,
    LossTally,
    ModelRunner,
    StepResult,
    broadcast_state,
    build_model,
    micro_batch_loss,
    new_adamw,
    optimizer_step,
    vocab_size_of,
)
from node.trainer.trainer import Trainer, TrainerError

log = logging.getLogger("prime_node.trainer")

LOOPBACK = "127.0.0.1"
# Followers wait in a broadcast while rank 0 collects a batch, which may take long: the process-group
# timeout must outlast the slowest batch. A dead rank 0 is noticed sooner: its sockets close (and a
# follower started by start_followers also watches its parent process).
DEFAULT_TIMEOUT = timedelta(hours=24)

OP_STOP, OP_FB, OP_APPLY, OP_GATHER, OP_SAVE, OP_NEW_OPTIMIZER, OP_INIT, OP_LOAD = 0, 1, 2, 3, 4, 5, 6, 7
OP_GATHER_ADAPTER, OP_SCOPE = 8, 9
_HEADER = 8  # float64: op, n_ints, n_floats, n_bytes, a0..a3
_LOSSES: dict[int, LossFn] = {1: sft_loss}  # by id on the wire; 0 = the trainer's own loss (the runner's loss_fn)


# ------------------------------------------------------------------------------- process group

def free_port() -> int:
    """An ephemeral TCP port on the loopback interface (free when asked; the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank (single node, loopback rendezvous)."""
    return {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}


def init_process_group(*, rank: int | None = None, world_size: int | None = None, port: int | None = None,
                       device: str = "cpu", timeout: timedelta = DEFAULT_TIMEOUT,
                       threads: int | None = None) -> tuple[int, int]:
    """Join the process group (gloo on CPU, NCCL on CUDA). Arguments not given come from the torchrun
    environment (RANK, WORLD_SIZE, MASTER_PORT); the address is always the loopback one. On CPU the
    machine's cores are split between the ranks unless `threads` says otherwise."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    port = int(os.environ["MASTER_PORT"]) if port is None else port
    addr = os.environ.get("MASTER_ADDR", LOOPBACK)
    if addr not in (LOOPBACK, "localhost"):
        raise TrainerError(f"trainer ranks rendezvous on {LOOPBACK} only, not {addr!r}")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, world_size


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- launching

def start_followers(world_size: int, port: int, *, device: str = "cpu", python: str = sys.executable,
                    cwd: str | Path | None = None) -> list[subprocess.Popen]:
    """Start ranks 1..world_size-1 as `python -m node.trainer.distributed` (the caller is rank 0 and must
    then call init_process_group(rank=0, world_size=..., port=port)). Each follower exits when this
    process dies (it watches its parent)."""
    procs = []
    root = Path(__file__).resolve().parents[2]
    for rank in range(1, world_size):
        env = {**os.environ, **rank_env(rank, world_size, port), "PRIME_TRAINER_DEVICE": device}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([python, "-m", "node.trainer.distributed"], env=env,
                                      stdin=subprocess.DEVNULL, cwd=str(cwd or root)))
    return procs


def _child(fn: Callable, args: tuple, rank: int, world_size: int, port: int, results) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException as e:  # reported to the parent, which raises
        import traceback

        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run fn(*args) in `world_size` fresh processes, as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port), and return their results in rank order. `fn` must
    be importable (a module-level function); it calls init_process_group() itself. For tests and
    benchmarks: the coordinator instead uses `launch` (it is rank 0 itself)."""
    import multiprocessing as mp

    # forkserver: the server imports torch once, and each rank is a fork of it (a fresh interpreter per
    # rank would pay the torch import every time); never a fork of this process, which may hold threads.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers", __name__])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, args, r, world_size, port, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except Exception:  # queue.Empty: check the children are alive
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank process exited with code {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed: {value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


def launch(world_size: int, model_dir: str | Path | None, cfg: TrainerConfig | None = None, *,
           resume_from: str | Path | None = None, device: str = "cpu", **kwargs: Any) -> Trainer:
    """For the coordinator: make this process rank 0 of `world_size` local ranks (followers started as
    subprocesses) and return its Trainer on an FSDPRunner -- fresh from `model_dir`, or resumed from the latest
    snapshot under `resume_from` (a state dir written by an FSDPRunner, any world size; the model
    is built from `model_dir`, or if None the base model recorded in the snapshot, then overwritten).
    Call `.close()` when done (stops the followers, leaves the process group)."""
    # The followers run in another working directory: every path they are sent must be absolute.
    model_dir = None if model_dir is None else Path(model_dir).resolve()
    resume_from = None if resume_from is None else Path(resume_from).resolve()
    if kwargs.get("state_dir") is not None:
        kwargs["state_dir"] = Path(kwargs["state_dir"]).resolve()
    port = free_port()
    procs = start_followers(world_size, port, device=device)
    try:
        init_process_group(rank=0, world_size=world_size, port=port, device=device)
        if resume_from is not None:
            trainer = Trainer.resume(resume_from, cfg, model_dir=model_dir, device=device, runner=FSDPRunner,
                                     **kwargs)
        else:
            assert model_dir is not None, "launch: a new trainer needs model_dir (only a resume can do without)"
            trainer = Trainer(model_dir, cfg, device=device, runner=FSDPRunner, **kwargs)
    except BaseException:
        for p in procs:
            p.kill()
        destroy_process_group()
        raise
    assert isinstance(trainer.runner, FSDPRunner)
    trainer.runner.followers = procs  # its close() stops them, its abort() kills them
    return trainer


# ------------------------------------------------------------------------------- batch codec

def encode_samples(samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples -> (int64 tensor, float64 tensor). Per sample: ints [len(prompt), len(completion),
    has_teacher, key0, key1, has_mask, *prompt, *completion, *mask if has_mask]; floats [advantage,
    *inference_logprobs, *teacher]."""
    ints: list[int] = []
    floats: list[float] = []
    for s in samples:
        teacher = s.teacher_logprobs is not None
        masked = s.loss_mask is not None
        ints += [len(s.prompt_ids), len(s.completion_ids), int(teacher), int(s.key[0]), int(s.key[1]), int(masked)]
        ints += s.prompt_ids
        ints += s.completion_ids
        if s.loss_mask is not None:  # masked
            ints += [int(b) for b in s.loss_mask]
        floats.append(float(s.advantage))
        floats += s.inference_logprobs
        if s.teacher_logprobs is not None:  # teacher
            floats += s.teacher_logprobs
    return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float64)


def decode_samples(ints: torch.Tensor, floats: torch.Tensor) -> list[TrainSample]:
    iv, fv = ints.tolist(), floats.tolist()
    out: list[TrainSample] = []
    i = f = 0
    while i < len(iv):
        lp, lc, teacher, k0, k1, masked = iv[i: i + 6]
        i += 6
        prompt, completion = iv[i: i + lp], iv[i + lp: i + lp + lc]
        i += lp + lc
        mask = None
        if masked:
            mask = [bool(b) for b in iv[i: i + lc]]
            i += lc
        adv = fv[f]
        lps = fv[f + 1: f + 1 + lc]
        f += 1 + lc
        tl = None
        if teacher:
            tl = fv[f: f + lc]
            f += lc
        out.append(TrainSample(prompt, completion, lps, adv, tl, key=(k0, k1), loss_mask=mask))
    if f != len(fv):
        raise TrainerError("malformed sample batch from rank 0")
    return out


def assign_micro_batches(sizes: list[int], world_size: int) -> list[list[int]]:
    """Micro-batch indices per rank: largest first onto the least-loaded rank (ties: lower rank), each
    rank's share in batch order. Deterministic, so every rank computes the same split."""
    load = [0] * world_size
    share: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        load[r] += sizes[i]
        share[r].append(i)
    return [sorted(s) for s in share]


# ------------------------------------------------------------------------------- the runner

class FSDPRunner(ModelRunner):
    """A model runner whose model is sharded with FSDP2 over the process group's ranks. On rank 0 a Trainer
    holds it (`Trainer(..., runner=FSDPRunner)`, or `launch`); on the other ranks `serve_follower()` builds
    one from rank 0's init message and runs its commands."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, temperature: float = 1.0, device: str = "cpu",
                 attn_implementation: str = "sdpa") -> None:
        if not dist.is_initialized():
            raise TrainerError("the FSDP runner needs the process group (init_process_group or launch)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.cfg = cfg
        self.temperature = temperature
        self.model_dir = Path(model_dir)
        self.followers: list[subprocess.Popen] = []  # the ranks `launch` started (rank 0 stops them on close)
        self._aborted = False
        # rank 0's unsharded copy for evaluation (full_model), made on first use
        self._full_model: torch.nn.Module | None = None
        self._extra_optimizer: torch.optim.Optimizer | None = None
        self._scope: ExitStack | None = None  # inside the warm start's scope (SCOPE 1): what leaving it undoes
        cuda = device.startswith("cuda")
        if cuda:
            device = f"cuda:{torch.cuda.current_device()}"
        self._comm_device = torch.device(device if cuda else "cpu")  # where collectives' tensors live (_send too)
        if self.rank == 0:  # tell the followers what to build (each picks its own GPU)
            init = {"model_dir": str(self.model_dir.resolve()), "cfg": cfg.model_dump(mode="json"),
                    "temperature": temperature, "device": "cuda" if cuda else "cpu",
                    "attn_implementation": attn_implementation}
            self._send(OP_INIT, text=json.dumps(init))
        self.model = build_model(model_dir, cfg, device=device, attn_implementation=attn_implementation)
        self._model_config = self.model.config  # the transformers config (rank 0's host copy is built from it)
        if cfg.lora.enabled:  # before sharding, from the RNG build_model seeded: every rank's adapters = one rank's
            self.model = lora.wrap(self.model, cfg.lora)
        self.vocab_size = vocab_size_of(self.model)  # before sharding: the embedding's full shape
        _shard(self.model)
        self.optimizer = new_adamw(self.model, cfg.lr, cfg)  # over the sharded parameters
        self.loss_fn = resolve_loss(cfg.mode, cfg.loss)

    # -- the runner's interface (rank 0: broadcast the command, then take part in it) ----------------
    def forward_backward(self, samples: list[TrainSample], loss_fn: LossFn, tally: LossTally) -> None:
        loss_id = 0 if loss_fn is self.loss_fn else next((k for k, v in _LOSSES.items() if v is loss_fn), None)
        if loss_id is None:
            raise TrainerError("the FSDP runner runs the trainer's own loss or sft_loss only")
        ints, floats = encode_samples(samples)
        self._send(OP_FB, ints=ints, floats=floats, args=(loss_id,))
        self._fb(samples, loss_id, tally)

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float, tokens: int) -> StepResult:
        which = 0 if optimizer is self.optimizer else 1
        if which and optimizer is not self._extra_optimizer:
            raise TrainerError("the FSDP runner steps its own optimizers only")
        self._send(OP_APPLY, args=(which, max_grad_norm, tokens))
        return self._apply(which, max_grad_norm, tokens)

    def new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The second optimizer (the SFT warm start's), on every rank; step() takes it as `which` 1."""
        self._send(OP_NEW_OPTIMIZER, args=(lr,))
        return self._new_extra_optimizer(lr)

    def weights_for_broadcast(self) -> dict[str, torch.Tensor]:
        self._send(OP_GATHER)
        if self.cfg.lora.enabled:  # merged under the base names: the LocalRunner's code on rank 0's host copy
            return broadcast_state(self._host_model(self._full_state_dict()), self.cfg)
        return self._gather()

    def adapter_for_broadcast(self) -> lora.BroadcastAdapter | None:
        """With trainer.lora: the adapter's factors unsharded (GATHER_ADAPTER: a few MB, not the model), as the
        LocalRunner gives them (lora.adapter_for_broadcast on rank 0's host copy, whose base is not read)."""
        if not self.cfg.lora.enabled:
            return None
        self._send(OP_GATHER_ADAPTER)
        model = self._host_model(None)
        lora.load_adapter(model, self._gather_adapter(), self.model_dir)
        return lora.adapter_for_broadcast(model, getattr(torch, self.cfg.broadcast_dtype))

    def full_model(self) -> torch.nn.Module:
        """Rank 0: a plain (unsharded, fp32, CPU) model holding the current weights, for evaluation
        (node/coordinator/evaluation.py); with trainer.lora the peft model, its adapters applied as on one rank.
        Every rank takes part in one GATHER; what rank 0 then does with the copy runs no collective, so nothing
        it does can wait on another rank. The copy is kept (one model of CPU memory) and refreshed at each call
        (weights_for_broadcast refreshes it too with trainer.lora: the coordinator evaluates and publishes from
        one thread)."""
        self._send(OP_GATHER)
        return self._host_model(self._full_state_dict())

    def warm_start_scope(self) -> AbstractContextManager[None]:
        # With trainer.lora the warm start trains the base, on every rank (SCOPE), as LocalRunner's does.
        return self._warm_start_scope() if self.cfg.lora.enabled else super().warm_start_scope()

    @contextmanager
    def _warm_start_scope(self) -> Iterator[None]:
        self._send(OP_SCOPE, args=(1,))
        self._set_scope(True)
        try:
            yield
        finally:
            self._set_scope(False)  # this rank's flags first: a dead follower must not leave the base trainable
            self._send(OP_SCOPE, args=(0,))

    def snapshot_meta(self) -> dict[str, Any]:
        meta = {"format": FSDP_FORMAT, "world_size": self.world_size, "base_model_dir": str(self.model_dir.resolve())}
        if self.cfg.lora.enabled:  # dcp/ holds the peft model's state (base and adapters) and the adapters' moments
            meta["lora"] = self.cfg.lora.model_dump()
        return meta

    def write_weights(self, tmp: Path) -> None:
        """Rank 0, collective: every rank writes its shard of model + optimizer under tmp/dcp (DCP); rank 0
        adds the model's config (the layout is node/trainer/distributed_state.py's)."""
        self._send(OP_SAVE, text=str(tmp / "dcp"))
        self._save_sharded(tmp / "dcp")
        (tmp / "model").mkdir()
        self._model_config.save_pretrained(str(tmp / "model"))

    def load_snapshot(self, snap: Path) -> None:
        """Rank 0, collective: every rank loads its shard of model + optimizer from snap/dcp (resharded from
        whatever number of ranks wrote it). A snapshot of another trainer.lora is refused first, on rank 0 alone."""
        from node.trainer.state import read_json

        lora.check_snapshot(snap, read_json(Path(snap) / "trainer.json").get("lora"), self.cfg.lora)
        self._send(OP_LOAD, text=str(Path(snap).resolve() / "dcp"))
        self._load_sharded(Path(snap).resolve() / "dcp")

    @classmethod
    def model_dir_of_snapshot(cls, snap: Path, meta: dict[str, Any], model_dir: str | Path | None) -> Path:
        return base_model_dir(snap, meta, model_dir)

    def close(self, timeout: float = 10.0) -> None:
        """Rank 0: stop the followers and leave the process group, within about `timeout` seconds: a
        follower that has not exited by then (stuck, or stopped) is killed. Never raises (it runs on the
        way out, after a failure too)."""
        deadline = time.monotonic() + timeout
        if self.rank == 0 and dist.is_initialized() and not self._aborted and \
                all(p.poll() is None for p in self.followers):
            try:
                self._send(OP_STOP)  # a few bytes per rank: the sockets' buffers take them even if none reads
            except Exception as e:  # noqa: BLE001 - a dead rank: the kill below is the stop
                log.warning("could not send STOP to the trainer ranks: %s", e)
        for p in self.followers:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("trainer rank (pid %d) did not stop within %.0f s; killed", p.pid, timeout)
                p.kill()
                p.wait()
        self.followers = []
        try:  # after the followers are gone: nothing left to wait for
            destroy_process_group()
        except Exception as e:  # noqa: BLE001
            log.warning("leaving the trainer's process group: %s", e)

    def abort(self) -> None:
        """Rank 0, from any thread: kill the followers now. A collective that rank 0 is blocked in then
        fails (its peers' sockets close), so the thread driving this trainer ends; close() afterwards
        only leaves the process group."""
        self._aborted = True
        for p in self.followers:
            if p.poll() is None:
                p.kill()

    # -- collective bodies (every rank) ------------------------------------------------------------
    def _fb(self, samples: list[TrainSample], loss_id: int, tally: LossTally) -> None:
        """This rank's share of the micro-batches, then the tallies summed over the ranks into `tally`."""
        loss_fn = self.loss_fn if loss_id == 0 else _LOSSES[loss_id]
        mbs = build_micro_batches(samples, self.cfg.packing, self.cfg.micro_batch_tokens)
        share = assign_micro_batches([mb.padded_tokens for mb in mbs], self.world_size)
        slots = max(len(s) for s in share)
        local = LossTally()
        mine = share[self.rank]
        for slot in range(slots):
            if slot < len(mine):
                self._micro_batch_backward(mbs[mine[slot]], loss_fn, local)
            else:
                self._dummy_backward()
        vec = [local.loss_sum, local.loss_tokens, local.nonfinite, local.tokens_processed]
        vec += [local.weighted.get(k, 0.0) for k in TOKEN_WEIGHTED]
        vec += [float(k in local.weighted) for k in TOKEN_WEIGHTED]
        t = torch.tensor(vec, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        v = t.tolist()
        tally.loss_sum += v[0]
        tally.loss_tokens += int(round(v[1]))
        tally.nonfinite += int(round(v[2]))
        tally.tokens_processed += int(round(v[3]))
        n = len(TOKEN_WEIGHTED)
        for i, k in enumerate(TOKEN_WEIGHTED):
            if v[4 + n + i] > 0:
                tally.weighted[k] = tally.weighted.get(k, 0.0) + v[4 + i]

    def _micro_batch_backward(self, mb: MicroBatch, loss_fn: LossFn, tally: LossTally) -> None:
        # LocalRunner.forward_backward's loop body, with the logprobs computed under FSDP.
        logprobs = _split_logprobs(self.model.prime_logprobs(mb, self.temperature), mb)
        total = micro_batch_loss(mb, logprobs, loss_fn, tally)
        tally.tokens_processed += mb.padded_tokens
        if total is not None and total.requires_grad:
            total.backward()
        else:  # keep the collectives in step with the other ranks
            zero = sum(lp.sum() for lp in logprobs) * 0.0
            assert isinstance(zero, torch.Tensor)  # a micro-batch holds at least one sample
            zero.backward()

    def _dummy_backward(self) -> None:
        """A pass that contributes exactly zero gradient, so that this rank joins the same all-gathers and
        reduce-scatters as the ranks that still have micro-batches."""
        mb = build_micro_batches([TrainSample([0], [0], [0.0], 0.0)], "packed", 64)[0]
        (self.model.prime_logprobs(mb, self.temperature).sum() * 0.0).backward()

    def _apply(self, which: int, max_grad_norm: float, tokens: int) -> StepResult:
        """LocalRunner.step on sharded gradients: the same division, clipping and skip rule."""
        from torch.distributed.tensor import DTensor

        optimizer = self.optimizer if which == 0 else self._extra_optimizer
        if optimizer is None:
            raise TrainerError("APPLY on the second optimizer before NEW_OPTIMIZER")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        if tokens > 0:
            for g in grads:
                g.div_(tokens)
        grad_norm = 0.0
        if tokens and grads:
            total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
            if isinstance(total, DTensor):
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, total)
            grad_norm = float(total)
        return StepResult(grad_norm, optimizer_step(optimizer, tokens, grad_norm))

    def _new_extra_optimizer(self, lr: float) -> torch.optim.Optimizer:
        self._extra_optimizer = new_adamw(self.model, lr, self.cfg)
        return self._extra_optimizer

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The collective of GATHER (every rank calls it): the full state dict on rank 0's CPU, {} elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # torch types the values as any state (DTensor, list, ...); a full, CPU-offloaded model state is tensors
        return cast(dict[str, torch.Tensor], full) if self.rank == 0 else {}

    def _gather_adapter(self) -> dict[str, torch.Tensor]:
        """The collective of GATHER_ADAPTER: every adapter parameter unsharded (DTensor.full_tensor, in parameter
        order: the same on every rank), fp32 on rank 0's CPU under its name in the wrapped model; {} elsewhere."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in lora.adapter_parameters(self.model).items():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                if self.rank == 0:
                    out[name] = full.detach().to(device="cpu", dtype=torch.float32, copy=True)
        return out

    def _host_model(self, full: dict[str, torch.Tensor] | None) -> Any:
        """Rank 0's plain fp32 CPU model (peft-wrapped with trainer.lora), made on first use, loaded with `full`
        (the wrapped model's full state dict) when given."""
        from transformers import AutoModelForCausalLM

        if self._full_model is None:
            with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the RNG alone
                model = AutoModelForCausalLM.from_config(self._model_config, dtype=torch.float32)
                if self.cfg.lora.enabled:
                    model = lora.wrap(model, self.cfg.lora)
            model.eval()
            self._full_model = model
        if full is not None:
            self._full_model.load_state_dict(full)
        return self._full_model

    def _set_scope(self, warm_start: bool) -> None:
        """SCOPE: enter (lora.base_trainable: the base's shards require a gradient, the adapters' do not; FSDP2
        takes the flags of the sharded parameters at each all-gather) or leave the warm start's scope."""
        if warm_start:
            if self._scope is not None:
                raise TrainerError("SCOPE: already in the warm start's scope")
            self._scope = ExitStack()
            self._scope.enter_context(lora.base_trainable(self.model))
        elif self._scope is not None:
            self._scope.close()
            self._scope = None

    def _gather(self) -> dict[str, torch.Tensor]:
        full = self._full_state_dict()
        if self.rank != 0:
            return {}
        dtype = getattr(torch, self.cfg.broadcast_dtype)
        return {name: full[name].detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
                for name in self._broadcast_keys()}

    def _broadcast_keys(self) -> list[str]:
        """state_dict keys minus tied duplicates (as LocalRunner.weights_for_broadcast drops them)."""
        seen: set[int] = set()
        dup: set[str] = set()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                dup.add(name)
            seen.add(id(p))
        return [k for k in self.model.state_dict() if k not in dup]

    def _load_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def _save_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))

    # -- the command channel -----------------------------------------------------------------------
    def _send(self, op: int, *, ints: torch.Tensor | None = None, floats: torch.Tensor | None = None,
              text: str | None = None, args: tuple = ()) -> None:
        """Rank 0: broadcast one command (no-op on one rank)."""
        if self.rank != 0:
            raise TrainerError("only rank 0 issues commands")
        if self.world_size == 1:
            return
        raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else None
        header = [op, 0 if ints is None else ints.numel(), 0 if floats is None else floats.numel(),
                  0 if raw is None else raw.numel(), *args]
        header += [0.0] * (_HEADER - len(header))
        dev = self._comm_device
        dist.broadcast(torch.tensor(header, dtype=torch.float64, device=dev), src=0)
        for t in (ints, floats, raw):
            if t is not None and t.numel():
                dist.broadcast(t.to(dev), src=0)

    def serve(self) -> None:
        """Followers: execute rank 0's commands until STOP."""
        while True:
            op, args, ints, floats, text = _receive(self._comm_device)
            if op == OP_STOP:
                return
            if op == OP_FB:
                assert ints is not None and floats is not None  # rank 0 sends the batch with FB
                self._fb(decode_samples(ints, floats), int(args[0]), LossTally())  # rank 0 keeps the tally
            elif op == OP_APPLY:
                self._apply(int(args[0]), float(args[1]), int(args[2]))
            elif op == OP_GATHER:
                self._full_state_dict()
            elif op == OP_GATHER_ADAPTER:
                self._gather_adapter()
            elif op == OP_SCOPE:
                self._set_scope(bool(args[0]))
            elif op == OP_SAVE:
                assert text is not None  # rank 0 sends the path with SAVE
                self._save_sharded(Path(text))
            elif op == OP_LOAD:
                assert text is not None  # rank 0 sends the path with LOAD
                self._load_sharded(Path(text))
            elif op == OP_NEW_OPTIMIZER:
                self._new_extra_optimizer(float(args[0]))
            else:
                raise TrainerError(f"unknown trainer command {op}")


def _shard(model) -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, output head)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise TrainerError(f"{type(model).__name__}: no decoder layers to shard")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():  # plain SUM over ranks (gloo has no PREMUL_SUM); APPLY divides by tokens
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    # micro_batch_logprobs calls the decoder and the output embedding directly, not model.forward:
    # run it as an FSDP forward method so the root's parameters are gathered (and reduced after).
    model.prime_logprobs = _bound_logprobs(model)
    register_fsdp_forward_method(model, "prime_logprobs")


def _bound_logprobs(model):
    from node.trainer.forward import micro_batch_logprobs

    def prime_logprobs(mb, temperature):
        # One tensor out (FSDP hooks its backward on the forward method's outputs), split by the caller.
        return torch.cat(micro_batch_logprobs(model, mb, temperature))

    return prime_logprobs


def _split_logprobs(lp: torch.Tensor, mb) -> list[torch.Tensor]:
    return list(torch.split(lp, [len(s.pred_index) for r in mb.rows for s in r.slices]))


def _text_of(t: torch.Tensor) -> str:
    return bytes(t.cpu().tolist()).decode()


def _receive(dev: torch.device) -> tuple[int, list[float], torch.Tensor | None, torch.Tensor | None, str | None]:
    header = torch.zeros(_HEADER, dtype=torch.float64, device=dev)
    dist.broadcast(header, src=0)
    h = header.tolist()
    op, n_int, n_float, n_bytes = (int(x) for x in h[:4])
    ints = floats = raw = None
    if n_int:
        ints = torch.empty(n_int, dtype=torch.int64, device=dev)
        dist.broadcast(ints, src=0)
    if n_float:
        floats = torch.empty(n_float, dtype=torch.float64, device=dev)
        dist.broadcast(floats, src=0)
    if n_bytes:
        raw = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
        dist.broadcast(raw, src=0)
    text = None if raw is None else _text_of(raw)
    return op, h[4:], ints, floats, text


def serve_follower(device: str | None = None) -> None:
    """Ranks 1..N-1 (process group already up): build the runner rank 0 describes, serve its commands."""
    device = device or os.environ.get("PRIME_TRAINER_DEVICE", "cpu")
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda") else "cpu")
    op, _, _, _, text = _receive(dev)
    if op != OP_INIT or text is None:
        raise TrainerError(f"expected the init message from rank 0, got command {op}")
    init = json.loads(text)
    cfg = TrainerConfig.model_validate(init["cfg"])
    FSDPRunner(init["model_dir"], cfg, temperature=float(init["temperature"]), device=init["device"],
               attn_implementation=init["attn_implementation"]).serve()


def _watch_parent(interval: float = 1.0) -> threading.Event:
    """A follower started by start_followers exits when rank 0's process (its parent) is gone. Returns the
    event that ends the watch."""
    parent = os.getppid()
    done = threading.Event()

    def watch():
        while not done.wait(interval):
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="rank0-watch", daemon=True).start()
    return done


def main() -> NoReturn:
    """A follower rank: serve rank 0 until STOP, then exit 0 (3 when rank 0 died first; a traceback and 1 when
    the group or a command failed).

    After a clean STOP the follower leaves with os._exit(0), without tearing down its process group or the
    interpreter: that teardown (gloo's C++ threads gloo_tcp_loop and pt_gloo_runloop are joined in it) now and
    then aborted the process after all its work was done ("terminate called without an active exception",
    SIGABRT; seen in CI in test_launch_starts_its_own_follower_rank). Its sockets close with the process,
    which rank 0 sees as it would a destroyed group (it is waiting for the exit, in no collective), and nothing
    is left to flush: rank 0 writes every file, and a follower's sharded save is complete when SAVE returns."""
    device = os.environ.get("PRIME_TRAINER_DEVICE", "cpu")
    watching = _watch_parent()
    init_process_group(device=device)
    try:
        serve_follower(device)
    except BaseException:
        watching.set()
        destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
