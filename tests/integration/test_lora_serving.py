"""worker.lora_serving = "adapter" (issue #29, Workers) on the transformers backend: the engine keeps the pinned base
and generates with each step's verified adapter unmerged (a forward hook per adapted layer) instead of loading the
fetcher's merged weights. The evidence (logprobs, commitments) comes from the adapted model: the coordinator's
verifier, which replays the merged weights, accepts every rollout of a real LoRA run; an adapter on another base
is refused. tests/integration/test_lora_serving_vllm.py runs the same on vLLM's own LoRA support."""
from __future__ import annotations

import pytest
import torch

from node.worker.backends import GenRequest, LoraAdapter
from node.worker.backends.transformers_backend import TransformersBackend
from protocol.checkpoint import CheckpointError, merge_lora
from tests.integration.coordinator_harness import running_coordinator
from tests.integration.swarm_harness import start_worker, stop_workers, wait_for
from tests.integration.test_verify_matrix import EOS, VOCAB, tiny_model
from verify.rollouts import RolloutVerifier

pytestmark = [pytest.mark.timeout(300)]

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=12, eos_token_id=EOS)


def random_adapter(model, seed: int, base: str, step: int = 1, scale: float = 0.1) -> LoraAdapter:
    """A LoRA adapter on every attention projection of `model`, large enough to change its samples (at scale 0.3,
    several times what training moves, 2 of 24 bf16 rollouts exceed the commitment limit by 2-3%)."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            out, inp = module.weight.shape
            pairs[name] = (torch.randn(RANK, inp, generator=g) * scale, torch.randn(out, RANK, generator=g) * scale)
    return LoraAdapter(step, base, RANK, ALPHA, pairs)


def merged_model(model, adapter: LoraAdapter):
    """The verifier's view: the protocol's merge of the same adapter into the same base (fp32)."""
    plain = {f"{m}.lora_A": a for m, (a, _) in adapter.pairs.items()} | \
            {f"{m}.lora_B": b for m, (_, b) in adapter.pairs.items()}
    out = tiny_model(0)
    out.load_state_dict(merge_lora(model.state_dict(), plain, rank=adapter.rank, alpha=adapter.alpha))
    return out.eval()


def verdicts(model, requests, results):
    v = RolloutVerifier(model)
    return [v.verify(q.prompt_ids, r, q.seed, SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["max_tokens"],
                     EOS) for q, r in zip(requests, results)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unmerged_adapter_generates_the_merged_policy(dtype):
    base = tiny_model(0)
    backend = TransformersBackend(tiny_model(0), dtype=dtype)
    backend.load_state_dict(base.state_dict(), 0, base="h0")
    requests = [GenRequest([1 + i, 5, 9, 11], 100 + i) for i in range(8)]
    plain = backend.generate(requests, **SAMPLING)
    adapter = random_adapter(base, 1, "h0")
    backend.load_adapter(adapter, 1)
    assert backend.policy_step == 1
    adapted = backend.generate(requests, **SAMPLING)
    assert [r.completion_ids for r in adapted] != [r.completion_ids for r in plain]
    assert all(v.ok for v in verdicts(merged_model(base, adapter), requests, adapted))
    # the adapter is what the evidence shows: the base alone does not explain these rollouts
    assert not any(v.ok for v in verdicts(base.eval(), requests, adapted))
    # the next step's adapter replaces it (no stacking), and a full payload drops it
    second = random_adapter(base, 2, "h0", step=2)
    backend.load_adapter(second, 2)
    assert all(v.ok for v in verdicts(merged_model(base, second), requests, backend.generate(requests, **SAMPLING)))
    backend.load_state_dict(base.state_dict(), 3, base="h3")
    again = backend.generate(requests, **SAMPLING)
    assert [r.logprobs for r in again] == [r.logprobs for r in plain]


def test_an_adapter_on_another_base_is_refused():
    base = tiny_model(0)
    backend = TransformersBackend(tiny_model(0))
    backend.load_state_dict(base.state_dict(), 0, base="h0")
    backend.load_adapter(random_adapter(base, 1, "h0"), 1)
    requests = [GenRequest([3, 4, 5], 7)]
    before = backend.generate(requests, **SAMPLING)
    with pytest.raises(CheckpointError) as e:
        backend.load_adapter(random_adapter(base, 2, "another-base", step=2), 2)
    assert e.value.code == "base_mismatch"
    # nor on merged weights (no base), nor an adapter that fits no layer of the model
    merged = TransformersBackend(tiny_model(0))
    merged.load_state_dict(base.state_dict(), 5)  # base=None: merged weights
    with pytest.raises(CheckpointError, match="base_mismatch|merged"):
        merged.load_adapter(random_adapter(base, 2, "h0", step=6), 6)
    bad = random_adapter(base, 3, "h0", step=3)
    name = next(iter(bad.pairs))
    wrong = LoraAdapter(3, "h0", RANK, ALPHA, {name: (bad.pairs[name][0], torch.zeros(VOCAB, RANK))})
    with pytest.raises(CheckpointError) as e:
        backend.load_adapter(wrong, 3)
    assert e.value.code == "bad_adapter"
    # the refused adapters changed nothing: the engine still generates step 1's policy
    assert backend.policy_step == 1
    assert [r.logprobs for r in backend.generate(requests, **SAMPLING)] == [r.logprobs for r in before]


async def serve_lora_run(tmp_path, *worker_args: str, wait_s: float = 180):
    """A real LoRA run (rank 8, 3 steps) with one worker serving its adapters unmerged; returns (coordinator status,
    worker node, coordinator) after the worker generated with step 3's adapter."""
    async with running_coordinator(tmp_path, "trainer.lora.rank=8", "run.max_steps=3", "run.batch_prompts=4",
                                   "run.group_size=4", "verification.fraction=1.0") as (coord, url):
        worker = start_worker(tmp_path, "w", coord, url, "worker.lora_serving=adapter", *worker_args)
        node = worker[0]
        try:
            await wait_for(lambda: coord.published_step >= 3 and node.policy_step >= 3, wait_s,
                           "3 training steps, the worker generating with step 3's adapter", coord, workers=[worker])
        finally:
            await stop_workers(worker)
        return coord.status(), node, coord


async def test_a_worker_serves_lora_adapters_unmerged_with_no_rejections(tmp_path):
    status, node, _ = await serve_lora_run(tmp_path)
    assert status["verification"]["rejected"] == 0 and status["verification"]["accepted"] > 0, status["verification"]
    assert node.stats.accepted > 0 and node.stats.rejected == 0
    store = node.fetcher.store
    assert store.manifest(3).encoding == "lora-adapter"
    # held as the fetcher rebuilt it, never merged into a full model (which the engine would not use)
    assert store.weights_path(3) == store.adapter_payload_path(3) and not store.payload_path(3).exists()
    # the engine holds the step 0 base it received and step 3's adapter, never merged weights
    assert node.backend.base == store.manifest(0).canonical_hash() and node.backend.policy_step >= 3
    assert len(node.backend._adapter_hooks) == len(LoraAdapter.from_store(store, node.backend.policy_step).pairs)
    assert_each_swap_moved(node)


def assert_each_swap_moved(node) -> None:
    """The probe (the fixed prompt, generated after each swap) moved at every swap, and the engine took at least two
    adapters one after the other. Which steps it took depends on timing: a node with k = 2 may go from step 1's
    adapter to step 3's (a CI run did), so the steps are not named."""
    probes = list(node._probes)
    steps = [p["policy_step"] for p in probes]
    assert steps == sorted(set(steps)) and steps[-1] >= 3 and len([s for s in steps if s >= 1]) >= 2, steps
    for a, b in zip(probes, probes[1:]):
        assert a["rollouts"][0]["logprobs"] != b["rollouts"][0]["logprobs"], (a["policy_step"], b["policy_step"])


def test_the_adapter_an_engine_gets_is_the_verified_checkpoint(tmp_path):
    """LoraAdapter.from_store rebuilds a held adapter step from its shard files against the signed manifest: the
    pairs, rank, alpha and pinned base are the manifest's; a shard changed on disk after the download is refused."""
    from node.checkpoint_dir import CheckpointDir
    from node.coordinator.publisher import Publisher
    from node.trainer import lora
    from node.trainer.config import LoraConfig
    from protocol.identity import Identity

    store = CheckpointDir(tmp_path / "ckpt")
    pub = Publisher(store, Identity.generate(), "run", async_level=2, shard_size=4096, level=3, full_every=1000)
    torch.manual_seed(1)
    model = lora.wrap(tiny_model(0), LoraConfig(rank=RANK, alpha=ALPHA, target_modules=list(TARGETS)))
    pub.publish(0, lora.base_state_dict(model), adapter=lora.adapter_for_broadcast(model, torch.bfloat16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    pub.publish(1, None, adapter=lora.adapter_for_broadcast(model, torch.bfloat16))
    m = store.manifest(1)
    adapter = LoraAdapter.from_store(store, 1)
    assert (adapter.base, adapter.rank, adapter.alpha) == (m.lora.base, m.lora.rank, m.lora.alpha)
    assert adapter.base == store.manifest(0).canonical_hash()
    sent = lora.plain_adapter(model)
    assert len(adapter.pairs) == len(sent) // 2
    for module, (a, b) in adapter.pairs.items():
        assert torch.equal(a, sent[f"{module}.lora_A"].to(torch.bfloat16))
        assert torch.equal(b, sent[f"{module}.lora_B"].to(torch.bfloat16))
    shard = store.shard_path(1, 0)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        LoraAdapter.from_store(store, 1)
