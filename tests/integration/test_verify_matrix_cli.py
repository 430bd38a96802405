"""`prime-node verify rollouts`: a real signed checkpoint, real rollouts, one tampered line."""
from __future__ import annotations

import json

import pytest
import torch

from node.cli import main
from node.worker.backends.base import GenRequest
from node.worker.backends.transformers_backend import TransformersBackend
from protocol.checkpoint import pack_checkpoint
from protocol.identity import Identity

EOS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("verify-cli")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    key = Identity.generate()
    ckpt = root / "ckpt-3"
    pack_checkpoint({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, ckpt, identity=key, step=3,
                    run_id="t")
    cfg.save_pretrained(root)  # config.json next to the checkpoint
    # The worker generates with the bf16 weights it unpacked, like a real node.
    worker = TransformersBackend(Qwen2ForCausalLM(cfg), dtype="bfloat16", device="cpu")
    worker.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, step=3)
    prompts = [{"prompt_id": f"p{i}", "prompt_ids": [5 + i, 9, 11 + i], "seeds": [100 * i, 100 * i + 1]}
               for i in range(3)]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16}
    rollouts = []
    for p in prompts:
        results = worker.generate([GenRequest(p["prompt_ids"], s) for s in p["seeds"]], temperature=1.0, top_p=1.0,
                                  max_tokens=16, eos_token_id=EOS)
        for j, r in enumerate(results):
            rollouts.append({"prompt_id": p["prompt_id"], "sample_index": j, "completion_ids": r.completion_ids,
                             "logprobs": r.logprobs, "finish_reason": r.finish_reason, "commitment": r.commitment})
    line = {"assignment_id": "a1", "prompts": prompts, "sampling": sampling, "eos_token_id": EOS,
            "policy_step": 3, "rollouts": rollouts}
    return root, ckpt, key, line, worker


def test_multi_turn_rollouts_have_every_model_turn_replayed(setup, capsys):
    """A two-turn episode played as a worker plays it (turn 1: the sequence so far plus the environment's
    tokens as its prompt, seed turn_seed(seed, 1)); then its second turn forged."""
    from verify.sampler import turn_seed

    root, ckpt, key, line, worker = setup
    env_ids = [3, 20, 21, 4]
    rollouts = []
    for p in line["prompts"]:
        for j, seed in enumerate(p["seeds"]):
            (first,) = worker.generate([GenRequest(p["prompt_ids"], seed)], temperature=1.0, top_p=1.0, max_tokens=16,
                                       eos_token_id=EOS)
            (second,) = worker.generate([GenRequest(p["prompt_ids"] + first.completion_ids + env_ids,
                                                    turn_seed(seed, 1))], temperature=1.0, top_p=1.0, max_tokens=16,
                                        eos_token_id=EOS)
            turn = {k: getattr(second, k) for k in ("completion_ids", "logprobs", "finish_reason", "commitment")}
            rollouts.append({"prompt_id": p["prompt_id"], "sample_index": j, "completion_ids": first.completion_ids,
                             "logprobs": first.logprobs, "finish_reason": first.finish_reason,
                             "commitment": first.commitment, "turns": [{"env_ids": env_ids, **turn}]})
    f = write(root / "multi.jsonl", [{**line, "rollouts": rollouts}])
    assert main(["verify", "rollouts", f, "--checkpoint", str(ckpt), "--key", key.public_hex]) == 0
    out = capsys.readouterr()
    assert out.out.count("ok [") == 6 and "environment's tokens were not checked" in out.err
    forged = [dict(r, turns=[dict(r["turns"][0], logprobs=[x * 0.5 for x in r["turns"][0]["logprobs"]])])
              for r in rollouts]
    f = write(root / "multi-bad.jsonl", [{**line, "rollouts": forged}])
    assert main(["verify", "rollouts", f, "--checkpoint", str(ckpt), "--key", key.public_hex]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(x.startswith("INVALID logprobs (model turn 1)") for x in lines)


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_all_valid_exit_0(setup, capsys):
    root, ckpt, key, line, _ = setup
    f = write(root / "good.jsonl", [line, {**line, "assignment_id": "a2"}])
    assert main(["verify", "rollouts", f, "--checkpoint", str(ckpt), "--key", key.public_hex]) == 0
    out = capsys.readouterr()
    assert out.out.count("ok [") == 12 and "INVALID" not in out.out
    assert "12 rollouts: 12 valid, 0 invalid" in out.err


def test_tampered_rollouts_exit_1(setup, capsys):
    root, ckpt, key, line, _ = setup
    bad = [dict(r) for r in line["rollouts"]]
    bad[0]["logprobs"] = [x * 0.5 for x in bad[0]["logprobs"]]
    bad[1]["commitment"] = bad[2]["commitment"] if len(bad[2]["completion_ids"]) > 1 else bad[3]["commitment"]
    bad[2]["sample_index"] = 7  # no such seed
    f = write(root / "bad.jsonl", [{**line, "rollouts": bad}, {**line, "policy_step": 2}])
    assert main(["verify", "rollouts", f, "--checkpoint", str(ckpt), "--key", key.public_hex]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("INVALID shape: sample_index 7")
    assert any(x.startswith("INVALID logprobs") and "prompt p0 sample 0" in x for x in out)
    assert any(x.startswith("INVALID commitment") and "prompt p0 sample 1" in x for x in out)
    assert sum(x.startswith("INVALID step") for x in out) == 6  # the whole second line claims step 2


def test_wrong_key_and_bad_input_are_one_line_errors(setup, capsys, tmp_path):
    root, ckpt, key, line, _ = setup
    f = write(tmp_path / "one.jsonl", [line])
    other = Identity.generate().public_hex
    assert main(["verify", "rollouts", f, "--checkpoint", str(ckpt), "--key", other]) == 1
    assert "error:" in capsys.readouterr().err
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"prompts": [], "nope": 1}\n')
    assert main(["verify", "rollouts", str(junk), "--checkpoint", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "junk.jsonl:1:" in err and "Traceback" not in err
    nan = tmp_path / "nan.jsonl"
    nan.write_text(json.dumps(line).replace('"temperature": 1.0', '"temperature": NaN') + "\n")
    assert main(["verify", "rollouts", str(nan), "--checkpoint", str(ckpt)]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["verify", "rollouts", str(tmp_path / "missing.jsonl"), "--checkpoint", str(ckpt)]) == 1


def test_model_config_from_another_directory(setup, capsys, tmp_path):
    import shutil

    root, ckpt, key, line, _ = setup
    lone = tmp_path / "elsewhere" / "ckpt-3"  # no config.json beside it
    shutil.copytree(ckpt, lone)
    f = write(tmp_path / "one.jsonl", [line])
    assert main(["verify", "rollouts", f, "--checkpoint", str(lone), "--key", key.public_hex]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main(["verify", "rollouts", f, "--checkpoint", str(lone), "--key", key.public_hex,
                 "--model-config", str(root)]) == 0
    assert "6 rollouts: 6 valid, 0 invalid" in capsys.readouterr().err
