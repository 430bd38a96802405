"""Per-rollout verification without trusting the worker (docs/PROTOCOL.md, "Work and submissions").

One recomputed prefill (prompt + completion, batched over rollouts) with the claimed step's weights
gives, at every completion position, the logits and the final hidden states. From them:

  shape        ids in the vocabulary, one logprob (finite, <= 0) per token, lengths within bounds,
               a commitment that decodes into one proof per 32-token chunk
  termination  "stop" only when the completion ends with its first EOS and EOS was really the
               sampler's choice there; "length" only when len == max_tokens and no EOS inside
  commitment   TOPLOC comparison of the committed top-k hidden values (verify.commitment)
  logprobs     submitted vs recomputed: max absolute deviation, and the mean over all tokens but the worst
  sampling     replaying the seeded Gumbel-max sampler picks the submitted tokens, up to numerical
               near-ties (the chosen token's perturbed score within `sample_margin` of the best)

Policy binding: the commitment and logprobs must match the weights of the step the caller loaded
(the coordinator enforces the staleness window itself). Thresholds are calibrated (bench/verify_cost.py)
so honest nodes on other hardware (bf16 generation, other batch sizes and thread counts, verified in
fp32) pass; see docs/BENCHMARKS.md.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .checks import Judgement as Judgement, RolloutClaim as RolloutClaim, VerifyItem as VerifyItem  # re-exported
from .checks import turn_items as turn_items  # torch-free
from .commitment import (TOPK, ChunkScore, CommitmentError, capture_final_hidden, chunk_bounds, parse_commitment,
                         score_commitment)
from .sampler import check_sampling, check_seed, replay_scores

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("prime_node.verify")

REASONS = ("shape", "termination", "commitment", "logprobs", "sampling")
# A token whose replay margin (logit units) is above this, yet within `sample_margin`, was not the seeded
# sampler's first choice by more than numerical noise: honest bf16-vs-fp32 noise exceeds it at <= 0.4 %
# of positions, while a node free to choose among passing tokens finds such a choice at 29-62 % of them
# (bench/near_ties.py). The coordinator bans a node whose rate of these is far above the honest one.
NEAR_TIE_MARGIN = 0.2


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> CUDA when there is a GPU, else the CPU; CUDA without a GPU is a clear error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU (use \"cpu\")")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {sorted(table)})")
    return table[dtype]


def left_pad(seqs: Sequence[Sequence[int]], *, pad_id: int, device: torch.device | str = "cpu",
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (input_ids, attention_mask, position_ids), all [B, L] int64.

    Positions count real tokens only, so a padded row computes what it would alone.
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.int64)
            mask[i, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


@torch.inference_mode()
def recompute(model: PreTrainedModel, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched prefill: fp32 logits [B, C, V] and final hidden states [B, C, H] at the positions
    that produced each completion token (row b is valid for its first len(completions[b]) entries).

    Rollouts of one prompt group share their prompt: each distinct prompt is prefilled once (left-padded,
    its KV cache then copied to the rows that share it), and the completions (right-padded, so every one
    starts in the same column) run on top of that cache. A group of G samples thus costs one prompt
    prefill instead of G (bench/real_step.py, docs/BENCHMARKS.md: a real-model replay 0.16x of before at load 8).
    Used by the verifier, and by backends that cannot expose hidden states while decoding (vLLM).
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    c = max(len(x) for x in completions)
    keys = [tuple(p) for p in prompts]
    distinct = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    owner = torch.tensor([distinct[k] for k in keys], dtype=torch.int64, device=device)
    ids, mask, pos = left_pad(list(distinct), pad_id=0, device=device)
    cache = DynamicCache(config=model.config)
    with capture_final_hidden(model) as captured:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        logits, hidden = out.logits.float()[owner], captured.pop()[owner]  # [B, 1, V], [B, 1, H]
        if c == 1:
            return logits, hidden
        # one copy of each prompt's keys and values per row that shares it (transformers annotates
        # torch.LongTensor, a type no tensor has statically)
        cache.reorder_cache(owner)  # type: ignore[arg-type]
        tail = torch.zeros((len(prompts), c - 1), dtype=torch.int64)
        tail_mask = torch.zeros_like(tail)
        for row, comp in enumerate(completions):
            comp = list(comp[:-1])  # the last token is never an input
            tail[row, :len(comp)] = torch.tensor(comp, dtype=torch.int64)
            tail_mask[row, :len(comp)] = 1
        tail_pos = pos[owner][:, -1:] + torch.arange(1, c, device=device)[None, :]
        out = model(input_ids=tail.to(device), attention_mask=torch.cat([mask[owner], tail_mask.to(device)], 1),
                    position_ids=tail_pos, past_key_values=cache, use_cache=True, logits_to_keep=c - 1)
        return torch.cat([logits, out.logits.float()], 1), torch.cat([hidden, captured.pop()], 1)


@dataclass(frozen=True)
class Thresholds:
    """Acceptance limits (calibrated in bench/verify_cost.py; see docs/BENCHMARKS.md).

    Logprob deviations and sampling margins are compared in logit units (multiplied by the temperature
    T): numerical noise lives in the logits, and dividing by a small T would magnify it.
    """

    # mean |submitted - recomputed| x T over the completion's tokens except its worst one (which `logprob_max`
    # bounds). One honest bf16 token may deviate up to ~0.4 (a rare, unlikely token: its logit and the
    # normaliser round apart), and in a short completion that one token alone used to carry the mean over its
    # limit: an honest vLLM-on-CPU bf16 node was banned so (docs/BENCHMARKS.md, "On the real model";
    # bench/verify_vllm_bf16.py: with every token counted, the worst 8-token prefix reached 0.98 of the limit).
    # The mean is there to catch a lie spread over many tokens, which leaving one out does not hide.
    logprob_mean: float = 0.1
    logprob_max: float = 0.6  # worst single token, x T
    # One token over logprob_max but within this, in a rollout whose every other check passes (its mean, the
    # commitment, every other token), is a numerical outlier, as one token off the sampler's choice is: the
    # coordinator voids its group (never trained on) and takes verification.outlier_penalty, but bans no one.
    # Honest bf16 does this about once in 11,000 tokens (bench/bf16_token_tail.py: 0.686 on an H200; 0.648 in
    # CI's real-model lane, which banned that node). A lie on one token gains nothing (it is never trained on),
    # and a node that keeps lying runs out of reputation.
    logprob_outlier_max: float = 1.2
    # The mean limit holds for means over at least this many tokens; fewer get it multiplied by
    # sqrt(mean_tokens / n): a mean of 2 tokens is nearly one token's noise. Seen on the GPU lane: a 2-token
    # SmolLM2 answer generated in CUDA bf16 had mean deviation 0.10001 (max 0.116) under the fp32 replay.
    mean_tokens: int = 8
    # False: the mean counts every token (the rule before bench/verify_vllm_bf16.py; kept to compare).
    mean_excludes_worst: bool = True
    sample_margin: float = 0.6  # perturbed-score gap x T tolerated as a numerical near-tie
    # probability mass by which top-p membership may be uncertain: bf16 generation verified in fp32 was
    # seen 0.0206 outside the fp32 nucleus (tests/integration/test_verify_matrix.py, a 2-head Qwen2)
    nucleus_slack: float = 0.05
    exp_mismatch_frac: float = 0.2  # TOPLOC: top-k entries with a different sign/exponent (per chunk)
    mant_err_mean: float = 5.0  # TOPLOC: mean mantissa difference in bf16 ulps (per chunk)
    mant_err_median: float = 4.0
    # The three TOPLOC limits hold for a chunk of TOPK points; a chunk with k < TOPK points (only in
    # models with hidden size < 512) gets them multiplied by sqrt(TOPK / k): fewer points, noisier stats.

    def logprob_mean_limit(self, n: int) -> float:
        """The limit of a mean over n tokens."""
        return self.logprob_mean * math.sqrt(max(1.0, self.mean_tokens / max(n, 1)))

    def logprob_verdict(self, dev: torch.Tensor) -> tuple[float, float, bool]:
        """Per-token deviations (x T) -> (the mean the rule checks, the max, whether either is over its limit)."""
        mean, worst, mean_bad = self.logprob_mean_check(dev)
        return mean, worst, worst > self.logprob_max or mean_bad

    def logprob_mean_check(self, dev: torch.Tensor) -> tuple[float, float, bool]:
        """Per-token deviations (x T) -> (the mean the rule checks, the max, whether the mean is over its limit).

        A 1-token completion has no mean beside its worst token: the max limit alone applies to it."""
        n, worst = dev.numel(), float(dev.max())
        if self.mean_excludes_worst:
            k = n - 1
            mean = (float(dev.sum()) - worst) / k if k else 0.0
        else:
            k, mean = n, float(dev.mean())
        return mean, worst, k > 0 and mean > self.logprob_mean_limit(k)

    def commitment_ratio(self, chunks: Sequence[ChunkScore]) -> tuple[float, ChunkScore]:
        """Worst (statistic / its limit) over chunks (> 1 fails), and the chunk it came from."""
        worst, where = -1.0, chunks[0]
        for c in chunks:
            f = math.sqrt(TOPK / c.points)
            r = max(c.exp_mismatch_frac / self.exp_mismatch_frac, c.mant_err_mean / self.mant_err_mean,
                    c.mant_err_median / self.mant_err_median) / f
            if r > worst:
                worst, where = r, c
        return worst, where


@dataclass
class Verdict:
    ok: bool
    reason: str | None = None  # one of REASONS when not ok
    detail: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    # failed by one token alone, every other check passed (Thresholds.logprob_outlier_max): possibly numerical
    outlier: bool = False


class RolloutVerifier:
    """Verify rollouts against `model` (the claimed step's weights; fp32 recommended).

    `max_batch_tokens` bounds one prefill (rows x padded length); `max_logit_elems` bounds the
    [rows, completion, vocab] fp32 logits kept at once.
    """

    def __init__(self, model: PreTrainedModel, *, thresholds: Thresholds | None = None,
                 max_batch_tokens: int = 32768, max_logit_elems: int = 2**27):
        self.model = model.eval()
        self.thresholds = thresholds or Thresholds()
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_batch_tokens = max_batch_tokens
        self.max_logit_elems = max_logit_elems

    def verify(self, prompt_ids: list[int], rollout: Any, seed: int, temperature: float, top_p: float,
               max_tokens: int, eos_token_id: int) -> Verdict:
        item = VerifyItem(list(prompt_ids), RolloutClaim.of(rollout), seed, temperature, top_p, max_tokens,
                          eos_token_id)
        return self.verify_many([item])[0]

    def verify_many(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        """Verdicts in input order; well-formed rollouts share batched prefills."""
        verdicts: list[Verdict | None] = [self._static_checks(it) for it in items]
        # Rollouts of one prompt next to each other: a batch prefills each distinct prompt once (recompute).
        todo = sorted((i for i, v in enumerate(verdicts) if v is None),
                      key=lambda i: (len(items[i].prompt_ids), items[i].prompt_ids, len(items[i].rollout.completion_ids)))
        batch: list[int] = []
        for i in todo:
            if batch and not self._fits(items, batch + [i]):
                self._verify_batch(items, batch, verdicts)
                batch = []
            batch.append(i)
        if batch:
            self._verify_batch(items, batch, verdicts)
        return verdicts  # type: ignore[return-value]

    # -- checks that need no model ------------------------------------------------------------

    def _static_checks(self, it: VerifyItem) -> Verdict | None:
        r = it.rollout
        v = self.vocab_size
        try:
            check_seed(it.seed)
            check_sampling(it.temperature, it.top_p)
        except ValueError as e:
            return Verdict(False, "shape", f"bad assignment: {e}")
        if not _int_list(it.prompt_ids, v) or not it.prompt_ids:
            return Verdict(False, "shape", "prompt ids missing or outside the vocabulary")
        if not _int_list(r.completion_ids, v) or not r.completion_ids:
            return Verdict(False, "shape", "completion ids missing or outside the vocabulary")
        n = len(r.completion_ids)
        if n > it.max_tokens:
            return Verdict(False, "shape", f"{n} tokens exceed max_tokens {it.max_tokens}")
        if not isinstance(r.logprobs, list) or len(r.logprobs) != n or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0.0
                for x in r.logprobs):
            return Verdict(False, "shape", "need one finite logprob <= 0 per completion token")
        if r.finish_reason not in ("stop", "length"):
            return Verdict(False, "shape", f"unknown finish_reason {r.finish_reason!r}")
        try:
            proofs = parse_commitment(r.commitment)
        except CommitmentError as e:
            return Verdict(False, "shape", f"commitment: {e}")
        if len(proofs) != len(chunk_bounds(n)):
            return Verdict(False, "shape", f"commitment has {len(proofs)} chunks, expected {len(chunk_bounds(n))}")
        eos_at = [j for j, t in enumerate(r.completion_ids) if t == it.eos_token_id]
        if r.finish_reason == "stop" and eos_at != [n - 1]:
            return Verdict(False, "termination", "'stop' needs exactly one EOS, as the last token")
        if r.finish_reason == "length" and (eos_at or n != it.max_tokens):
            return Verdict(False, "termination", "'length' needs max_tokens tokens and no EOS")
        return None

    # -- checks on one recomputed prefill ------------------------------------------------------

    def _fits(self, items: Sequence[VerifyItem], idx: list[int]) -> bool:
        p = max(len(items[i].prompt_ids) for i in idx)
        c = max(len(items[i].rollout.completion_ids) for i in idx)
        return (len(idx) * (p + c) <= self.max_batch_tokens
                and len(idx) * c * self.vocab_size <= self.max_logit_elems)

    def _prefill(self, items: Sequence[VerifyItem], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return recompute(self.model, [items[i].prompt_ids for i in idx],
                         [items[i].rollout.completion_ids for i in idx])

    def _verify_batch(self, items: Sequence[VerifyItem], idx: list[int], verdicts: list[Verdict | None]) -> None:
        logits, hidden = self._prefill(items, idx)
        # Replay the sampler for every rollout sharing (temperature, top_p) in one vectorised call.
        groups: dict[tuple[float, float], list[int]] = {}
        for row, i in enumerate(idx):
            groups.setdefault((items[i].temperature, items[i].top_p), []).append(row)
        for (temperature, top_p), rows in groups.items():
            lens = [len(items[idx[r]].rollout.completion_ids) for r in rows]
            flat_logits = torch.cat([logits[r, :n] for r, n in zip(rows, lens)])
            dev = flat_logits.device
            chosen = torch.tensor([t for r in rows for t in items[idx[r]].rollout.completion_ids], device=dev)
            seeds = torch.tensor([items[idx[r]].seed for r, n in zip(rows, lens) for _ in range(n)], device=dev)
            positions = torch.cat([torch.arange(n, device=dev) for n in lens])
            rep = replay_scores(flat_logits, seeds, positions, temperature, top_p, chosen,
                                nucleus_slack=self.thresholds.nucleus_slack)
            parts = [torch.stack(x).cpu().split(lens, dim=1)
                     for x in [(rep.margin, rep.outside, rep.logprob_lo, rep.logprob_hi)]][0]
            for r, part in zip(rows, parts):
                verdicts[idx[r]] = self._judge(items[idx[r]], part, hidden[r])

    def _judge(self, it: VerifyItem, replay: torch.Tensor, hidden: torch.Tensor) -> Verdict:
        """replay: [4, n] = margin, outside, logprob_lo, logprob_hi per completion position."""
        th = self.thresholds
        r = it.rollout
        n = len(r.completion_ids)
        margins, outside, lp_lo, lp_hi = replay
        submitted = torch.tensor(r.logprobs, dtype=torch.float32)
        scale = it.temperature if it.temperature > 0 else 1.0  # to logit units (see Thresholds)
        margins = margins * scale
        # Distance from the submitted logprob to the interval the nucleus uncertainty allows.
        dev = (torch.clamp(lp_lo - submitted, min=0) + torch.clamp(submitted - lp_hi, min=0)) * scale
        lp_mean, lp_max, mean_bad = th.logprob_mean_check(dev)
        lp_bad = mean_bad or lp_max > th.logprob_max
        com_ratio, com = th.commitment_ratio(score_commitment(parse_commitment(r.commitment), hidden[:n]))
        bad_pick = (margins > th.sample_margin) | (outside > th.nucleus_slack)
        # One token off (its logprob, or the sampler's choice, or both) and nothing else: bf16 generation can do
        # that to an honest node (bench/near_ties.py, bench/bf16_token_tail.py); more than one is a forgery.
        odd = int(((dev > th.logprob_max) | bad_pick).sum())
        outlier = odd == 1 and com_ratio <= 1.0 and not mean_bad and lp_max <= th.logprob_outlier_max
        scores = {
            "logprob_mean": lp_mean, "logprob_max": lp_max,
            "sample_margin_max": float(margins.max()), "sample_bad_positions": int(bad_pick.sum()),
            # tokens that were not the replayed sampler's first choice by more than noise, yet passed
            "near_tie_positions": int(((margins > NEAR_TIE_MARGIN) & ~bad_pick).sum()),
            "exp_mismatch_frac": com.exp_mismatch_frac, "mant_err_mean": com.mant_err_mean,
            "mant_err_median": com.mant_err_median, "commitment_ratio": com_ratio, "tokens": n,
        }
        if com_ratio > 1.0:
            return Verdict(False, "commitment", "activation commitment does not match the recomputed states", scores)
        if lp_bad:
            return Verdict(False, "logprobs", "submitted logprobs differ from the recomputed ones", scores, outlier)
        if bool(bad_pick[:-1].any()):
            return Verdict(False, "sampling", f"the seeded sampler would not pick token "
                           f"{int(bad_pick.nonzero()[0])}", scores, outlier)
        if bool(bad_pick[-1]):
            # The last token decides termination: a forced EOS (or a forced final token) is caught here.
            reason = "termination" if r.finish_reason == "stop" else "sampling"
            return Verdict(False, reason, "the seeded sampler would not pick the final token", scores, outlier)
        return Verdict(True, None, "", scores)


def judge(model: PreTrainedModel, items: Sequence[VerifyItem], *, claimed: bool = True) -> list[Judgement]:
    """Replay `items` against `model`, one Judgement each, in order. `claimed`: the weights are the step the rollouts
    claim, so a failure is news and is logged; False for the stale-step audit's replay against the step before,
    where most rollouts are expected to fail (a healthy demo logged 16 "rollout failed" lines a step)."""
    return [judgement(v, log_failure=claimed) for v in RolloutVerifier(model).verify_many(items)]


def judgement(v: Verdict, *, log_failure: bool = True) -> Judgement:
    """A verdict as the coordinator acts on it: a single-token outlier is voided, any other failure is a forgery."""
    if not v.ok and log_failure:  # which statistic and by how much: what an operator (or a failed CI run) needs
        log.info("rollout failed verify_%s%s: %s %s", v.reason, " (one token: outlier)" if v.outlier else "",
                 v.detail, {k: round(x, 4) for k, x in v.scores.items()})
    return Judgement(None if v.ok else f"verify_{v.reason}", int(v.scores.get("tokens", 0)),
                     int(v.scores.get("near_tie_positions", 0)), v.outlier, _fit(v))


def _fit(v: Verdict) -> float | None:
    """The rollout's fit to the replayed step for the stale-step audit (Judgement.fit): its mean logprob
    deviation, bounded as the wire bounds it; None when the replay computed none (a shape failure)."""
    x = v.scores.get("logprob_mean")
    return None if x is None or math.isnan(x) else min(float(x), 1e6)


def _int_list(xs: Any, vocab: int) -> bool:
    return isinstance(xs, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in xs)


def verdict_dict(v: Verdict) -> dict[str, Any]:
    return asdict(v)
