"""Lay training samples out into rows (pure Python: no torch here).

Three layouts, all producing the same per-token logprobs:

- `padded`: one sample (prompt + completion) per row, rows right-padded to the longest; the usual
  causal mask. A prompt shared by G samples is recomputed G times.
- `packed`: samples concatenated into rows of at most `micro_batch_tokens`; each sample is its own
  attention island (block-diagonal causal mask), positions restart at 0 per sample.
- `shared_prompt`: a prompt and all its completions in one island: `[prompt, c1, c2, ..., cG]`.
  Completion j attends to the prompt and to itself only, and its positions continue from the
  prompt's end, so each completion sees exactly what it would see alone -- but the prompt is
  computed once instead of G times.

Each token carries (block, part): attention is allowed from q to k iff same block, k ≤ q, and k is
in the block's prompt (part −1) or in q's own part.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainSample:
    """One completion to train on, with its per-token data (completion-aligned)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]
    advantage: float
    teacher_logprobs: list[float] | None = None
    key: tuple[int, int] = (0, 0)  # (group index, rollout index) for bookkeeping
    loss_mask: list[bool] | None = None  # False on tokens not trained on (a multi-turn environment's); None: all


@dataclass
class SampleSlice:
    sample: TrainSample
    row: int  # row within the micro-batch
    pred_index: list[int]  # row positions whose logits predict each completion token


@dataclass
class Row:
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    block: list[int] = field(default_factory=list)
    part: list[int] = field(default_factory=list)
    slices: list[SampleSlice] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    rows: list[Row]
    custom_mask: bool  # False: plain causal + padding mask (padded layout)

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * max(len(r) for r in self.rows)


def _append_island(row: Row, prompt: list[int], samples: list[TrainSample], share_prompt: bool, row_index: int) -> None:
    """Append one attention island (a prompt and its completions) to `row`."""
    first_block = (row.block[-1] + 1) if row.block else 0
    groups = [samples] if share_prompt else [[s] for s in samples]
    for g, members in enumerate(groups):
        block = first_block + g
        p_start = len(row)
        row.input_ids += prompt
        row.position_ids += list(range(len(prompt)))
        row.block += [block] * len(prompt)
        row.part += [-1] * len(prompt)
        last_prompt = p_start + len(prompt) - 1
        for j, s in enumerate(members):
            c_start = len(row)
            n = len(s.completion_ids)
            row.input_ids += s.completion_ids
            row.position_ids += list(range(len(prompt), len(prompt) + n))
            row.block += [block] * n
            row.part += [j] * n
            # Token t is predicted by the logits at the token before it in *this* sequence: the last
            # prompt token for t = 0, the previous completion token otherwise.
            row.slices.append(SampleSlice(s, row_index, [last_prompt] + list(range(c_start, c_start + n - 1))))


def _islands(samples: list[TrainSample], layout: str, limit: int) -> list[tuple[list[int], list[TrainSample]]]:
    """(prompt, completions) units to place, split so that none exceeds `limit` tokens."""
    if layout != "shared_prompt":
        return [(s.prompt_ids, [s]) for s in samples]
    units: list[tuple[list[int], list[TrainSample]]] = []
    by_prompt: dict[tuple[int, ...], list[TrainSample]] = {}
    for s in samples:  # samples of one group are adjacent; dict keeps first-seen order
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    for prompt, members in by_prompt.items():
        current: list[TrainSample] = []
        size = len(prompt)
        for s in members:
            if current and size + len(s.completion_ids) > limit:
                units.append((list(prompt), current))
                current, size = [], len(prompt)
            current.append(s)
            size += len(s.completion_ids)
        units.append((list(prompt), current))
    return units


def build_micro_batches(samples: list[TrainSample], layout: str, micro_batch_tokens: int) -> list[MicroBatch]:
    """Split samples into micro-batches of at most `micro_batch_tokens` tokens (a single sample longer
    than that gets a micro-batch of its own). Order is kept, so the layout is deterministic."""
    if layout not in ("padded", "packed", "shared_prompt"):
        raise ValueError(f"unknown packing layout {layout!r}")
    if layout == "padded":
        batches: list[MicroBatch] = []
        rows: list[Row] = []
        longest = 0
        for s in samples:
            n = len(s.prompt_ids) + len(s.completion_ids)
            if rows and max(longest, n) * (len(rows) + 1) > micro_batch_tokens:
                batches.append(MicroBatch(rows, custom_mask=False))
                rows, longest = [], 0
            row = Row()
            _append_island(row, s.prompt_ids, [s], True, len(rows))
            rows.append(row)
            longest = max(longest, n)
        if rows:
            batches.append(MicroBatch(rows, custom_mask=False))
        return batches
    # Packed layouts: one row per micro-batch, filled greedily in order.
    batches = []
    row = Row()
    for prompt, members in _islands(samples, layout, micro_batch_tokens):
        size = len(prompt) + sum(len(s.completion_ids) for s in members)
        if len(row) and len(row) + size > micro_batch_tokens:
            batches.append(MicroBatch([row], custom_mask=True))
            row = Row()
        _append_island(row, prompt, members, layout == "shared_prompt", 0)
    if len(row):
        batches.append(MicroBatch([row], custom_mask=True))
    return batches
