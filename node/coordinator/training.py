"""The training thread: waits for batch n, trains, publishes θ_n, repeats.

Crash safety: trainer state for step n and checkpoint n are written first (atomically, each to its
own directory), then one ledger transaction records step n and marks the groups it consumed. On
restart the ledger's newest step is the truth: anything newer on disk is discarded and redone.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from node.checkpoint_dir import CheckpointDir
from node.config import Config
from node.coordinator.batch_health import STALE, BatchHealth, drop_reason
from node.coordinator.evaluation import Evaluator, model_to_evaluate, warm_start_seed
from node.coordinator.faults import crash_point, fault_point
from node.coordinator.ledger import Ledger, StepRow, now_ms
from node.coordinator.metrics import CoordinatorMetrics
from node.coordinator.publisher import Publisher
from node.coordinator.records import DropReason, GroupRow, StoredRollout
from node.coordinator.run_model import RunModel
from node.coordinator.scheduler import min_policy_for_batch
from node.coordinator.status import TrainerSnapshot
from node.coordinator.verification import PolicyStore
from node.envs.episode import episode_of, pack

if TYPE_CHECKING:
    from node.trainer import Rollout
    from node.trainer.trainer import Trainer  # node.trainer's lazy names are Any to a type checker

log = logging.getLogger("prime_node.training")

STOP_AFTER_ABORT_S = 2.0  # once the other ranks are killed, rank 0's collective fails within moments
MIN_CLOSE_S = 1.0  # the least time the other ranks get to exit after STOP before they are killed
VOID_POLL_S = 10.0  # how often the waiting loop counts groups voided by verification (batch health)


def trainable(r: StoredRollout, policy_step: int) -> Rollout:
    """A stored rollout as the trainer takes it: a multi-turn episode packed into one sequence, with the
    environment's tokens masked out of the loss."""
    from node.trainer import Rollout  # torch stays out of the coordinator's start-up imports

    first, rest = episode_of(r)
    ids, logprobs, mask = pack(first, rest)
    return Rollout(completion_ids=ids, inference_logprobs=logprobs, reward=r.reward, policy_step=policy_step,
                   finish_reason=(rest[-1].model if rest else first).finish_reason, turns=1 + len(rest),
                   loss_mask=mask if rest else None)


class TrainingLoop:
    """`on_groups_dropped(by_batch, keep_rate)` and `on_step_published(step, consumed)` are called from this
    thread; the coordinator hands in callables that are safe to call from it (they post to its loop)."""

    def __init__(self, *, cfg: Config, storage: Path, ledger: Ledger, checkpoints: CheckpointDir,
                 publisher: Publisher, policies: PolicyStore, model: RunModel, metrics: CoordinatorMetrics,
                 on_groups_dropped: Callable[[dict[int, int], float], None],
                 on_step_published: Callable[[int, dict[int, int]], None]):
        self.cfg = cfg
        self.k = cfg.run.async_level
        self.storage = Path(storage)
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.policies = policies
        self.model = model
        self.metrics = metrics
        self.on_groups_dropped = on_groups_dropped
        self.on_step_published = on_step_published
        self.published_step = 0
        self.trainer: Trainer | None = None  # made by restore_or_init (rank 0's, with trainer.ranks > 1)
        self.state_root = self.storage / "trainer_state"
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0
        self.busy = False
        self.last_metrics: dict = {}
        self.error: str | None = None
        self.evaluator: Evaluator | None = None  # when eval.every_steps > 0
        # usable / unusable groups of the batch being collected, and the stall warning (batch_health.py)
        self._voided_polled = float("-inf")
        self.health = BatchHealth(needed=cfg.run.batch_prompts,
                                  warn_after=cfg.run.stall_warn_groups or 4 * cfg.run.batch_prompts,
                                  warn_interval_s=cfg.run.stall_warn_interval_s, metrics=metrics)
        self.health.observe_voided(ledger.verdict_counts().get("void", 0))  # the baseline: voids before this start
        if metrics is not None:  # read at each scrape: nothing else has to remember to set them
            metrics.trainer_busy.set_function(lambda: self.busy_seconds)
            metrics.trainer_idle.set_function(lambda: self.idle_seconds)

    def snapshot(self) -> "TrainerSnapshot":
        """What the status shows of the training loop (any thread: plain reads of values it replaces whole)."""
        ev = self.evaluator
        return TrainerSnapshot(busy=self.busy, busy_seconds=self.busy_seconds, idle_seconds=self.idle_seconds,
                               error=self.error, last_metrics=dict(self.last_metrics),
                               batch_health=self.health.snapshot(),
                               eval_curve=None if ev is None else list(ev.curve))

    # -- start-up ----------------------------------------------------------------------------------
    def _make_trainer(self, resume: bool) -> Trainer:
        from node.trainer import Trainer

        # The trainer's logprobs must be of the distribution the sampler used (temperature-scaled).
        kwargs: dict[str, Any] = dict(batch_prompts=self.cfg.run.batch_prompts, stream=self.cfg.run.stream_groups,
                                      temperature=self.cfg.sampling.temperature)
        if self.cfg.trainer.ranks > 1:  # FSDP2: this process is rank 0 and starts the others (torchrun-style)
            from node.trainer.distributed import launch

            return launch(self.cfg.trainer.ranks, self.model.model_dir, self.cfg.trainer, state_dir=self.state_root,
                          resume_from=self.state_root if resume else None, device=self.cfg.trainer.device,
                          **kwargs)
        kwargs["device"] = self.cfg.trainer.device
        if resume:
            return Trainer.resume(self.state_root, self.cfg.trainer, **kwargs)
        return Trainer(self.model.model_dir, self.cfg.trainer, state_dir=self.state_root, **kwargs)

    def _rewind_trainer_state(self, step: int) -> bool:
        """Point the trainer's LATEST at the snapshot of `step`, dropping newer ones (written before a
        crash that the ledger never recorded). Returns False if that snapshot is missing."""
        wanted = self.state_root / f"step-{step:08d}"  # node/trainer/state.py's snapshot layout
        if not wanted.is_dir():
            return False
        for d in self.state_root.glob("step-*"):
            if d.is_dir() and d.name > wanted.name:
                shutil.rmtree(d, ignore_errors=True)
        tmp = self.state_root / "LATEST.tmp"
        tmp.write_text(wanted.name)
        tmp.replace(self.state_root / "LATEST")
        return True

    def restore_or_init(self) -> None:
        latest = self.ledger.latest_step()
        store = self.checkpoints
        if latest is None:
            store.discard_after(-1)
            shutil.rmtree(self.state_root, ignore_errors=True)
            self.trainer = self._make_trainer(resume=False)
            metrics = {"note": "initial policy", **self._warm_start()}
            self._publish(0, metrics, [])
            self._start_eval()
            return
        step = latest.step
        log.info("resuming from published step %d", step)
        store.discard_after(step)
        if step > 0 and not self._rewind_trainer_state(step):
            raise RuntimeError(f"trainer state for published step {step} is missing under {self.state_root}")
        self.trainer = self._make_trainer(resume=step > 0)
        self.published_step = step
        for s in range(max(0, step - self.k - 1), step + 1):
            if store.payload_path(s).is_file():
                self.policies.put_payload(s, store.payload_path(s))
        self._start_eval()

    # -- warm start and evaluation (node/coordinator/evaluation.py) ---------------------------------
    def _warm_start(self) -> dict:
        """θ_0 = the tiny SFT warm start on the task's reference answers (trainer.warm_start_steps > 0)."""
        steps = self.cfg.trainer.warm_start_steps
        if not steps:
            return {}
        from node.trainer import sft_warm_start

        t0 = time.monotonic()
        nll = sft_warm_start(self.trainer, self.model.task, self.model.tokenizer, steps=steps,
                             lr=self.cfg.trainer.warm_start_lr, seed=warm_start_seed(self.cfg.run.seed))
        log.info("warm start: %d SFT steps, reference NLL %.3f -> %.3f", steps, nll[0], nll[-1])
        return {"warm_start_steps": steps, "warm_start_nll": nll[-1], "warm_start_seconds": time.monotonic() - t0}

    def _start_eval(self) -> None:
        self.evaluator = Evaluator.for_run(self.cfg, self.model, storage=self.storage, metrics=self.metrics)
        if self.evaluator is not None:
            self.evaluator.restore(self.published_step)

    def _evaluate_if_due(self) -> None:
        """Between steps, in this thread (it owns the model): a failed evaluation is logged, never fatal."""
        ev = self.evaluator
        if ev is None or not ev.due(self.published_step):
            return
        t0 = time.monotonic()
        try:
            ev.run(model_to_evaluate(self.trainer), self.published_step)
        except Exception:  # noqa: BLE001 - evaluation must not stop training
            log.exception("evaluation at step %d failed", self.published_step)
            ev.every_steps = 0  # off for the rest of this run; the curve so far stays
        self.busy_seconds += time.monotonic() - t0

    # -- thread ------------------------------------------------------------------------------------
    def start(self, start_thread: Callable[[Callable[[], None], str], threading.Thread] | None = None) -> None:
        """Start the training thread, through `start_thread(target, name)` when given (the coordinator's
        supervisor, which owns the thread and notices its death)."""
        if start_thread is None:
            self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)
            self._thread.start()
        else:
            self._thread = start_thread(self._run, "trainer")

    def stop(self, timeout: float | None = None) -> None:
        """Stop between groups or after the step being trained (and published), waiting at most `timeout`
        seconds (None: as long as it takes). A thread still busy then -- a long step, or a collective that a
        stuck trainer rank never answers -- is cut: the trainer's other ranks are killed (rank 0's collective
        then fails and the thread ends), and a step cut short is redone after a restart (crash safety)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("the training thread did not stop within %.1f s; stopping the trainer's ranks", timeout)
                abort = getattr(self.trainer, "abort", None)
                if abort is not None:
                    abort()
                assert timeout is not None  # join(None) returns only once the thread has ended
                t.join(min(timeout, STOP_AFTER_ABORT_S))
            if t.is_alive():  # a daemon thread: it does not keep the process from exiting
                log.warning("the training thread is still running; leaving it behind")
                return
        if self.trainer is None:
            return
        if deadline is None or getattr(self.trainer, "abort", None) is None:  # deadline: None iff timeout is
            self.trainer.close()
        else:  # a distributed trainer: its other ranks get what is left of the deadline to stop, then are killed
            self.trainer.close(timeout=max(MIN_CLOSE_S, deadline - time.monotonic()))

    @property
    def running(self) -> bool:
        """The training thread is alive (after stop(): it was left behind, stuck)."""
        return self._thread is not None and self._thread.is_alive()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def notify_decided(self) -> None:
        """A verdict was recorded (the verification thread): it may complete a batch or void groups, which the
        batch's health counts at the loop's next turn (not only every VOID_POLL_S)."""
        self._voided_polled = float("-inf")
        self.notify()

    def _run(self) -> None:
        """The thread's body. An exception ends it: the run cannot go on. It is kept in `error` for status
        and raised on, to the thread's owner (the supervisor fails the coordinator; a plain thread logs it)."""
        try:
            while not self._stop:
                self._evaluate_if_due()
                max_steps = self.cfg.run.max_steps
                if max_steps and self.published_step >= max_steps:
                    self._wait(1.0)
                    continue
                self._train_one_step(self.published_step + 1)
        except Exception as e:
            self.busy = False
            self.error = f"{type(e).__name__}: {e}"
            raise

    def _observe_voided(self) -> None:
        """Groups voided by verification never reach this loop: count them from the ledger, at most every
        VOID_POLL_S while waiting (the count scans the groups table; status reads it on every build too)."""
        t = time.monotonic()
        if t - self._voided_polled >= VOID_POLL_S:
            self._voided_polled = t
            self.health.observe_voided(self.ledger.verdict_counts().get("void", 0))

    def _wait(self, timeout: float) -> None:
        t0 = time.monotonic()
        with self._cond:
            if not self._stop:
                self._cond.wait(timeout)
        self.idle_seconds += time.monotonic() - t0

    def _train_one_step(self, n: int) -> None:
        from node.trainer import Group

        fault_point("train-step")
        ledger, trainer = self.ledger, self.trainer
        assert trainer is not None  # restore_or_init made it before the thread started
        idle0, busy0 = self.idle_seconds, self.busy_seconds
        min_m = min_policy_for_batch(n, self.k)
        fed: list[GroupRow] = []
        seen: set[int] = set()
        dropped: dict[DropReason, list[GroupRow]] = {"stale": [], "filtered": []}
        self.health.begin_batch(n)
        while not self._stop and not trainer.batch_complete:
            # ids first: parsing every waiting group's JSON at every poll cost a quarter of a loaded
            # coordinator's CPU (bench/load.py)
            fresh = ledger.groups([i for i in ledger.waiting_group_ids() if i not in seen])
            if not fresh:
                self._observe_voided()
                self._wait(0.5)
                continue
            just_dropped: list[GroupRow] = []
            for g in fresh:
                seen.add(g.group_id)
                if g.policy_step < min_m:
                    dropped["stale"].append(g)
                    just_dropped.append(g)
                    self.health.record_unusable(STALE)
                    continue
                t0 = time.monotonic()
                self.busy = True
                group = Group(prompt_id=g.prompt_id, prompt_ids=g.prompt_ids,
                              rollouts=[trainable(r, g.policy_step) for r in g.rollouts])
                kept = trainer.add_group(group)
                self.busy = False
                self.busy_seconds += time.monotonic() - t0
                if kept:
                    fed.append(g)
                    self.health.record_usable()
                else:
                    dropped["filtered"].append(g)
                    just_dropped.append(g)
                    self.health.record_unusable(drop_reason([r.reward for r in g.rollouts]))
                if trainer.batch_complete:
                    break
            if just_dropped:  # the scheduler asks for replacements now
                self.on_groups_dropped(dict(Counter(g.batch_step for g in just_dropped)),
                                       float(trainer.keep_rate))
        if self._stop:
            return
        t0 = time.monotonic()
        self.busy = True
        metrics = trainer.step()
        # every fresh rollout offered to this step, also the groups the difficulty filter dropped (all
        # right or all wrong): leaving those out hid the prompts the policy had mastered from the curve
        rewards = [r.reward for g in fed + dropped["filtered"] for r in g.rollouts]
        staleness = [n - 1 - g.policy_step for g in fed]
        metrics.update({
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "groups": len(fed), "dropped_stale": len(dropped["stale"]), "dropped_filtered": len(dropped["filtered"]),
            "max_staleness": max(staleness, default=0),
            "staleness_hist": dict(Counter(staleness)),
            "train_seconds": time.monotonic() - t0,
        })
        metrics["idle_seconds"] = self.idle_seconds - idle0  # waiting for rollouts during this step
        metrics["busy_seconds"] = self.busy_seconds - busy0 + time.monotonic() - t0  # up to publishing
        self._publish(n, metrics, fed, {why: [g.group_id for g in gs] for why, gs in dropped.items() if gs})
        self.busy = False
        self.busy_seconds += time.monotonic() - t0

    def _publish(self, n: int, metrics: dict, fed: list[GroupRow],
                 dropped: dict[DropReason, list[int]] | None = None) -> None:
        t0 = time.monotonic()
        trainer = self.trainer
        assert trainer is not None  # restore_or_init made it before publishing anything
        if n > 0:
            trainer.save_state()
        state = trainer.weights_for_broadcast()
        pub = self.publisher.publish(n, state, adapter=trainer.adapter_for_broadcast())
        metrics = {**metrics, "publish_seconds": time.monotonic() - t0, "encoding": pub.encoding,
                   "compressed_bytes": pub.compressed_bytes}
        if n > 0:
            crash_point("publish")
        self.ledger.publish_step(StepRow(n, now_ms(), pub.manifest_hash, pub.encoding, pub.base_step,
                                           pub.compressed_bytes, _jsonable(metrics)),
                                   [g.group_id for g in fed], dropped)
        self.policies.put(n, state if pub.weights is None else pub.weights)  # an adapter step: base + adapter
        self.published_step = n
        self.last_metrics = metrics
        removed = self.publisher.prune(n)
        consumed = Counter(g.batch_step for g in fed)
        self.on_step_published(n, dict(consumed))
        log.info("step %d published (%s, %d bytes, reward %.3f)%s", n, pub.encoding, pub.compressed_bytes,
                 metrics.get("reward_mean", 0.0), f"; pruned {removed}" if removed else "")


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, dict):
            v = {str(a): (b.item() if hasattr(b, "item") else b) for a, b in v.items()}
        out[k] = v
    return out
