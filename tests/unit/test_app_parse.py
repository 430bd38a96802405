"""The coordinator's request parser (node/coordinator/app.py, parse_wire): pydantic's JSON parser in one pass
instead of json.loads + model_validate. That parser reads NaN and ±Infinity; every wire model must refuse them."""
import inspect

import pytest
from pydantic import BaseModel

from node.coordinator.app import parse_wire
from node.http import ApiError, parse_body
from protocol import messages as M

ROLLOUT = ('{"prompt_id":"p","sample_index":0,"completion_ids":[1,2],"logprobs":[-0.5,%s],'
           '"finish_reason":"length","commitment":""}')


def submit(logprob: str) -> bytes:
    return ('{"assignment_id":"a","policy_step":0,"rollouts":[%s]}' % (ROLLOUT % logprob)).encode()


def test_every_wire_model_refuses_non_finite_floats():
    models = [m for _, m in inspect.getmembers(M, inspect.isclass) if issubclass(m, BaseModel) and m is not BaseModel
              and m.__module__ == M.__name__]
    assert len(models) > 20
    assert [m.__name__ for m in models if m.model_config.get("allow_inf_nan") is not False] == []


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "-1e400"])
def test_non_finite_logprob_is_refused(bad):
    with pytest.raises(ApiError) as e:
        parse_wire(M.SubmitRequest, submit(bad))
    assert e.value.status == 400 and e.value.code == "malformed" and "rollouts.0.logprobs.1" in e.value.detail


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "1e400"])
def test_non_finite_heartbeat_float_is_refused(bad):
    with pytest.raises(ApiError) as e:
        parse_wire(M.HeartbeatRequest, b'{"tokens_per_second": %s}' % bad.encode())
    assert e.value.status == 400 and "tokens_per_second" in e.value.detail


@pytest.mark.parametrize("body", [b"", b"{}", b"{", b"[1]", b"\xff\xfe", b"[" * 100_000, b'{"policy_step": -1}',
                                  b'{"policy_step": 1, "x": 2}', b'{"policy_step": 99999999999999999999999}',
                                  b'{"policy_step": 3}', b'{"policy_step": 3.5}', b'{"policy_step": "3"}'])
def test_same_answers_as_parse_body(body):
    """Accepted or refused (400 malformed, the same first words) exactly where json.loads + model_validate was."""
    def outcome(parse):
        try:
            return ("ok", parse(M.WorkRequest, body))
        except ApiError as e:
            return (e.status, e.code, e.detail.split(":")[0])
    assert outcome(parse_wire) == outcome(parse_body)


def test_a_good_submission_parses():
    req = parse_wire(M.SubmitRequest, submit("-1.25"))
    assert isinstance(req, M.SubmitRequest) and req.rollouts[0].logprobs == [-0.5, -1.25]
