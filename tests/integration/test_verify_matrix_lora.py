"""Honest matrix and attack matrix for LoRA rollouts (issue #29, "Verification"): real tiny Qwen2, a real peft
adapter trained by real AdamW steps, published through the real Publisher (signed `lora-adapter` checkpoints,
docs/PROTOCOL.md, "lora-adapter"), rebuilt the way a worker's fetcher rebuilds it (verify the manifests, rebuild the
payloads from their shards, `merge_adapter_payload` into the pinned full step 0), real transformers generation in
bf16, verified in fp32 by the RolloutVerifier replaying the claimed step's merged weights. Nothing mocked.

Honest: rollouts from the merged weights a worker loads, and from peft's unmerged model (the base as received plus
the live adapter, peft's forward), both accepted by the merged verifier; the largest |logprob| gap between the two
forms is printed. Attacks: a node that claims adapter step n but generates with step n - 1's adapter (the issue's
named case), with the base alone, with the adapter at twice its scale, with the adapter on only some of its
targets, and forged logprobs on LoRA rollouts; each must be rejected, for the reason asserted.

Detection power of "step n - 1 for step n" depends on how far one optimizer step moves the merged weights, and is
per rollout: the verifier's limits are set for bf16 noise, so a step that moves the adapted matrices by less than that
noise is indistinguishable one rollout at a time. Measured here (24 rollouts, `lora_run(lr=...)`, step 3 vs 2, the
relative Frobenius change of the most-moved adapted matrix): 1.0% -> 0/24 rejected (mean logprob deviation 0.055
against 0.016 for honest rollouts of the same prompts: separable over a node's many rollouts, not in one), 1.6% ->
15/24 (commitment 11, logprobs 4), 2.3% (LR below) -> 24/24 (commitment). LR = 2e-2 is therefore just above the
per-rollout threshold, as the full-parameter matrix's `test_attack_different_step` sits 2.5x above its own. Below
it, the coordinator's stale-step audit catches the node over its rollouts (node/coordinator/stale_audit.py,
tests/integration/test_stale_audit_lora.py).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from node.checkpoint_dir import CheckpointDir
from node.coordinator.publisher import Publisher
from node.trainer import lora
from node.trainer.config import LoraConfig
from protocol.checkpoint import load_payload, merge_lora
from protocol.checkpoint.adapter import A_SUFFIX, B_SUFFIX, adapter_pairs
from protocol.identity import Identity
from tests.integration.test_verify_matrix import (
    EOS,
    MAX_TOKENS,
    SAMPLING,
    VOCAB,
    TransformersEngine,
    copy_logprobs,
    edit_tokens,
    items_for,
    perturb_logprobs,
    prompts,
    recomputed_logprobs,
    tiny_model,
)
from tests.unit.test_checkpoint_adapter import _worker_rebuild
from verify.rollouts import RolloutVerifier

RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the default (node/trainer/config.py)
LR = 2e-2
STEPS = 3  # adapter steps 1..STEPS after the full step 0
BROADCAST = torch.bfloat16  # trainer.broadcast_dtype's default: the base and the adapter travel in bf16
N_ATTACK = 24
ENGINE = TransformersEngine()


def _adam_step(model, opt, seed: int) -> None:
    """One real AdamW step on a next-token loss over random tokens (the adapter only: the base is frozen)."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, VOCAB, (8, 32), generator=g)
    model.train()
    opt.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    model.eval()


def _plain(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The tiny Qwen2 (fp32 parameters) holding `weights` (dtype converted)."""
    m = tiny_model(0)
    m.load_state_dict(weights)
    return m.eval()


def _unmerged(base_weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A worker's unmerged form: the base as received, wrapped by peft with the received adapter (peft's forward
    adds alpha / rank * B @ A x on the fly; nothing merged)."""
    torch.manual_seed(0)
    model = lora.wrap(_plain(base_weights), LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    own = lora.plain_adapter(model)
    assert own.keys() == adapter.keys()
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(adapter[name])
    return model.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return lora_run(tmp_path_factory.mktemp("pub"), tmp_path_factory.mktemp("worker"))


def lora_run(root, tmp, lr: float = LR) -> dict:
    """Steps 0..STEPS published by the real Publisher into `root` and rebuilt by a worker's path in `tmp`. Returns
    a dict with `weights` {step: merged weights the worker rebuilt}, `adapters` {step: the adapter payload a worker
    received}, `base` (step 0's payload) and `rel` {step: relative change of the adapted matrices from step - 1}."""
    key = Identity.generate()
    pub = Publisher(CheckpointDir(root), key, "run", async_level=STEPS + 1, shard_size=64 * 1024, level=3,
                    full_every=1000)
    torch.manual_seed(1)
    model = lora.wrap(tiny_model(0), LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    base_state = {k: v.to(BROADCAST) for k, v in lora.base_state_dict(model).items()}
    pub.publish(0, base_state, adapter=lora.adapter_for_broadcast(model, BROADCAST))
    weights = {0: load_payload(CheckpointDir(root).payload_path(0))}
    adapters, rel = {}, {}
    for step in range(1, STEPS + 1):
        _adam_step(model, opt, seed=1000 + step)
        published = pub.publish(step, None, adapter=lora.adapter_for_broadcast(model, BROADCAST))
        assert published.encoding == "lora-adapter"
        rebuilt = _worker_rebuild(root, step, key, tmp)
        for name, w in published.weights.items():  # the coordinator replays the very weights the worker rebuilt
            assert torch.equal(rebuilt[name], w), name
        weights[step] = rebuilt
        adapters[step] = load_payload(tmp / f"adapter-{step}.safetensors")
        adapted = [f"{m}.weight" for m in adapter_pairs(adapters[step], RANK)]
        rel[step] = max(float((rebuilt[n].float() - weights[step - 1][n].float()).norm()
                              / weights[step - 1][n].float().norm()) for n in adapted)
    assert any(t.abs().max() > 0 for n, t in adapters[STEPS].items() if n.endswith(B_SUFFIX))
    print("relative change of the adapted matrices per step (max over matrices):",
          {s: f"{r:.4f}" for s, r in rel.items()})
    return {"weights": weights, "adapters": adapters, "base": weights[0], "rel": rel}


@pytest.fixture(scope="module")
def verifier(run):
    return RolloutVerifier(_plain(run["weights"][STEPS]).float())


@pytest.fixture(scope="module")
def merged_model(run):
    return _plain(run["weights"][STEPS])


@pytest.fixture(scope="module")
def honest(merged_model):
    ps, seeds = prompts(N_ATTACK, seed=42), [77_000 + i for i in range(N_ATTACK)]
    return ps, seeds, ENGINE.generate(merged_model, ps, seeds, dtype="bfloat16", batch=8, threads=None,
                                      temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, eos_token_id=EOS)


def _gen(model, ps, seeds, *, dtype="bfloat16", batch=8, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS):
    return ENGINE.generate(model, ps, seeds, dtype=dtype, batch=batch, threads=None, temperature=temperature,
                           top_p=top_p, max_tokens=max_tokens, eos_token_id=EOS)


def assert_all_rejected(verifier, items, allowed: set[str], honest_results=None):
    """As test_verify_matrix's: every attacked rollout rejected for one of `allowed`; one that reproduced the honest
    rollout token for token (both models sampled the same short answer) is no attack and is skipped, but at most
    10% may be."""
    if honest_results is not None:
        real = [it for it, h in zip(items, honest_results) if it.rollout.completion_ids != h.completion_ids]
        assert len(real) >= 0.9 * len(items), f"the attack reproduced the honest output {len(items) - len(real)} times"
        items = real
    verdicts = verifier.verify_many(items)
    accepted = [v for v in verdicts if v.ok]
    assert not accepted, f"{len(accepted)} of {len(verdicts)} attacked rollouts accepted, e.g. {accepted[0].scores}"
    for v in verdicts:
        assert v.reason in allowed, f"rejected for {v.reason!r}, expected one of {allowed}: {v}"


# --- honest ---------------------------------------------------------------------------------------

HONEST_CONFIGS = [  # (form, dtype, batch, sampling index): 8 x 64 = 512 rollouts
    ("merged", "bfloat16", 64, 0), ("merged", "bfloat16", 5, 1), ("merged", "float32", 16, 0),
    ("merged", "bfloat16", 8, 2), ("unmerged", "bfloat16", 64, 0), ("unmerged", "bfloat16", 7, 1),
    ("unmerged", "float32", 16, 0), ("unmerged", "bfloat16", 8, 2),
]


def _honest_matrix(run, verifier, merged_model, configs, n: int = 64) -> int:
    unmerged = _unmerged(run["base"], run["adapters"][STEPS])
    total, worst = 0, {"merged": {}, "unmerged": {}}
    for k, (form, dtype, batch, si) in enumerate(configs):
        temperature, top_p = SAMPLING[si]
        ps, seeds = prompts(n, seed=200 + k), [20_000 * (k + 1) + i for i in range(n)]
        res = _gen(merged_model if form == "merged" else unmerged, ps, seeds, dtype=dtype, batch=batch,
                   temperature=temperature, top_p=top_p)
        for v in verifier.verify_many(items_for(ps, seeds, res, temperature, top_p)):
            assert v.ok, f"honest LoRA rollout rejected ({form}, {dtype}, batch {batch}): {v}"
            for name, x in v.scores.items():
                worst[form][name] = max(worst[form].get(name, 0), x)
            total += 1
    for form, scores in worst.items():
        print(f"{total} honest LoRA rollouts accepted; worst {form} scores:",
              {n: round(x, 4) for n, x in scores.items()})
    return total


@pytest.mark.slow  # ~2 min of CPU on 2 cores (512 rollouts); the quick variant below runs by default
def test_honest_lora_matrix_merged_and_unmerged_never_rejected(run, verifier, merged_model):
    assert _honest_matrix(run, verifier, merged_model, HONEST_CONFIGS) >= 500


def test_honest_lora_rollouts_merged_and_unmerged_accepted(run, verifier, merged_model):
    """The quick sample of the matrix above: 32 bf16 rollouts of each form."""
    assert _honest_matrix(run, verifier, merged_model, [HONEST_CONFIGS[0], HONEST_CONFIGS[5]], n=32) == 64


def test_merged_and_unmerged_forms_agree(run, merged_model):
    """The same seeds through both forms: how far peft's unmerged forward is from the merged weights (bf16 and fp32
    generation), in sampled tokens and logprobs."""
    unmerged = _unmerged(run["base"], run["adapters"][STEPS])
    ps, seeds = prompts(16, seed=7), [3_000 + i for i in range(16)]
    for dtype in ("float32", "bfloat16"):
        a, b = _gen(merged_model, ps, seeds, dtype=dtype), _gen(unmerged, ps, seeds, dtype=dtype)
        same = [(x, y) for x, y in zip(a, b) if x.completion_ids == y.completion_ids]
        gap = max(max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) for x, y in same)
        print(f"{dtype}: {len(same)}/{len(a)} rollouts token-identical merged vs unmerged, max |dlogprob| {gap:.2e}")
        if dtype == "float32":
            # fp32 generation: the only difference is the merge's rounding of W + s B A to the base's bf16 (up to half
            # a bf16 spacing of W per element), which peft's unmerged forward never rounds. Measured: 15/16 identical,
            # 0.053 nat; the verifier's tolerance is what decides, and the honest matrix above shows it accepts both.
            assert len(same) >= 0.75 * len(a) and gap < 0.25, (len(same), gap)


# --- attacks --------------------------------------------------------------------------------------

MODEL_SWAP = {"commitment", "logprobs", "sampling"}  # what generating with other weights can be caught by


def test_attack_claims_step_n_generates_with_step_n_minus_1(run, verifier, honest):
    ps, seeds, _ = honest
    print(f"step {STEPS} vs {STEPS - 1}: adapted matrices moved {run['rel'][STEPS]:.4f} (relative)")
    lie = _gen(_plain(run["weights"][STEPS - 1]), ps, seeds)
    assert_all_rejected(verifier, items_for(ps, seeds, lie), MODEL_SWAP)


def test_attack_base_alone(run, verifier, honest):
    ps, seeds, _ = honest
    lie = _gen(_plain(run["base"]), ps, seeds)
    assert_all_rejected(verifier, items_for(ps, seeds, lie), MODEL_SWAP)


def test_attack_adapter_at_twice_its_scale(run, verifier, honest):
    ps, seeds, _ = honest
    twice = merge_lora(run["base"], run["adapters"][STEPS], rank=RANK, alpha=2 * ALPHA)
    lie = _gen(_plain(twice), ps, seeds)
    assert_all_rejected(verifier, items_for(ps, seeds, lie), MODEL_SWAP)


@pytest.mark.parametrize("kept", [("q_proj", "k_proj"), ("q_proj", "k_proj", "v_proj")])
def test_attack_adapter_on_some_targets_only(run, verifier, honest, kept):
    ps, seeds, _ = honest
    some = {n: t for n, t in run["adapters"][STEPS].items()
            if n.removesuffix(A_SUFFIX).removesuffix(B_SUFFIX).rsplit(".", 1)[-1] in kept}
    assert 0 < len(some) < len(run["adapters"][STEPS])
    lie = _gen(_plain(merge_lora(run["base"], some, rank=RANK, alpha=ALPHA)), ps, seeds)
    assert_all_rejected(verifier, items_for(ps, seeds, lie), MODEL_SWAP)


def test_attack_forged_logprobs_on_lora_rollouts(verifier, honest):
    ps, seeds, res = honest
    assert_all_rejected(verifier, items_for(ps, seeds, copy_logprobs(res)), {"logprobs"})
    assert_all_rejected(verifier, items_for(ps, seeds, perturb_logprobs(res)), {"logprobs"})
    assert_all_rejected(verifier, items_for(ps, seeds, edit_tokens(res)),
                        {"commitment", "logprobs", "sampling", "termination"})


def test_attack_greedy_with_forged_logprobs_on_lora(run, verifier, honest, merged_model):
    ps, seeds, res = honest
    greedy = _gen(merged_model, ps, seeds, temperature=0.0)
    ref = copy.deepcopy(merged_model).float()
    forged = [replace(r, logprobs=recomputed_logprobs(ref, p, r.completion_ids, s)) for p, s, r in zip(ps, seeds, greedy)]
    assert_all_rejected(verifier, items_for(ps, seeds, forged), {"sampling", "termination", "shape"},
                        honest_results=res)
