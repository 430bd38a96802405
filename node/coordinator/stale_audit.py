"""The stale-step audit: catches a node that claims step n but generates with step n - 1's weights (a lazy node
that did not fetch the new step, or a LoRA node that kept the previous adapter), over its many rollouts.

Per rollout, the replay against the claimed step cannot tell: its limits are set for bf16-vs-fp32 noise, and one
optimizer step may move the weights by less than that (tests/integration/test_verify_matrix_lora.py: at a 1.0 %
relative change 0/24 rollouts of step n - 1 are rejected as step n). But every such rollout fits step n - 1 better
than step n, while an honest rollout fits its own step better (or, when the two steps barely differ, either one
at random). So for a secret sample of a node's verified submissions the verifier replays the same rollouts against
step n - 1 as well (one extra replay per audited rollout; the coordinator holds k + 2 steps anyway), and compares
the two fits: the mean |claimed logprob - recomputed logprob| (x T) under each step, as the verifier computes it.

The decision is a one-sided sign test over disjoint windows of `window` audited rollouts: a rollout counts 1 when
the older step fits it better, 0 when the claimed one does, and not at all when the two fits are equal (the two
steps hold the same weights, or a fit is missing). A window with at least `threshold` ones flags the node. For
an honest node each counted rollout is a 1 with probability at most 1/2 (its own step is never the worse fit in
expectation), so a window flags it with probability at most `alpha` (the binomial tail at p = 1/2, computed
exactly below), and over N audited rollouts at most N / window * alpha times in expectation.

No IO: a small class with one short list per node, for at most `max_nodes` nodes (the least recently audited
forgotten first), like node/coordinator/pacing.py.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable

REASON = "verify_stale_step"  # the rejection (Rejection.reason) a flagged node is banned for


def sign_threshold(window: int, alpha: float) -> int:
    """The fewest ones among `window` fair coin flips whose probability (the upper tail) is at most `alpha`;
    window + 1 (never flags) when even all ones is more likely than that."""
    tail = 0
    for k in range(window, -1, -1):
        tail += math.comb(window, k)
        if tail / 2 ** window > alpha:
            return k + 1
    return 0  # unreachable for alpha < 1 (the whole distribution sums to 1)


def false_alarm_rate(window: int, threshold: int) -> float:
    """P(a window flags an honest node) at the worst case p = 1/2: the exact binomial tail."""
    return sum(math.comb(window, k) for k in range(threshold, window + 1)) / 2 ** window


class StaleAudit:
    def __init__(self, window: int = 16, alpha: float = 1e-3, max_nodes: int = 100_000):
        if window < 1 or not 0 < alpha < 1 or max_nodes < 1:
            raise ValueError(f"bad stale audit: window {window}, alpha {alpha}, max_nodes {max_nodes}")
        self.window, self.alpha, self.max_nodes = window, alpha, max_nodes
        self.threshold = sign_threshold(window, alpha)
        self._signs: OrderedDict[str, list[bool]] = OrderedDict()  # node -> the open window's counted rollouts

    def record(self, node_id: str, fits: Iterable[tuple[float | None, float | None]]) -> bool:
        """One audited submission's rollouts: (fit under the claimed step, fit under step - 1) each, a smaller
        fit being better. True when a window closed with the node flagged (its state is then forgotten)."""
        signs = self._signs.pop(node_id, [])
        self._signs[node_id] = signs  # most recently audited last
        flagged = False
        for claimed, older in fits:
            if claimed is None or older is None or claimed == older:
                continue  # no evidence either way
            signs.append(older < claimed)
            if len(signs) == self.window:
                flagged = flagged or sum(signs) >= self.threshold
                signs.clear()
        if flagged:
            self.forget(node_id)
        while len(self._signs) > self.max_nodes:
            self._signs.popitem(last=False)
        return flagged

    def forget(self, node_id: str) -> None:
        self._signs.pop(node_id, None)

    def nodes(self) -> int:
        return len(self._signs)

    def false_alarm_rate(self) -> float:
        """The bound per window for an honest node (at most `alpha`)."""
        return false_alarm_rate(self.window, self.threshold)
