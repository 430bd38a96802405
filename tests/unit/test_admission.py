"""Admission primitives (docs/PROTOCOL.md, "Admission"): proof of work bound to key and run, join tokens signed by the
coordinator with expiry."""
import pytest

from protocol.admission import (AdmissionError, check_join_token, check_pow, leading_zero_bits, make_join_token,
                                pow_digest, solve_pow)
from protocol.identity import Identity


LOG2_N = 4  # a tiny scrypt: these tests are about the rules, bench/pow_cost.py about the cost


def test_pow_is_bound_to_the_key_and_the_run():
    node = Identity.generate()
    nonce = solve_pow(node.public_hex, "run-a", 10, LOG2_N)
    check_pow(node.public_hex, "run-a", nonce, 10, LOG2_N)
    assert leading_zero_bits(pow_digest(node.public_hex, "run-a", bytes.fromhex(nonce), LOG2_N)) >= 10
    # worth nothing for another key, another run or another N (2**-10 chance each of being valid by luck)
    other = Identity.generate()
    for key, run, log2_n in ((other.public_hex, "run-a", LOG2_N), (node.public_hex, "run-b", LOG2_N),
                             (node.public_hex, "run-a", LOG2_N + 1)):
        if leading_zero_bits(pow_digest(key, run, bytes.fromhex(nonce), log2_n)) < 10:
            with pytest.raises(AdmissionError) as e:
                check_pow(key, run, nonce, 10, log2_n)
            assert e.value.code == "bad_pow"


def test_pow_is_scrypt_as_the_protocol_says():
    """Written from docs/PROTOCOL.md ("Admission") with hashlib directly: scrypt(key || run || nonce, salt, N, 8, 1)."""
    import hashlib

    node = Identity.generate()
    nonce = solve_pow(node.public_hex, "run-a", 6, LOG2_N)
    digest = hashlib.scrypt(bytes.fromhex(node.public_hex) + b"run-a" + bytes.fromhex(nonce),
                            salt=b"prime-node/join-pow/scrypt-v1", n=2**LOG2_N, r=8, p=1, dklen=32)
    assert int.from_bytes(digest, "big") >> (256 - 6) == 0


def test_pow_parameters_are_bounded():
    node = Identity.generate()
    for log2_n in (0, 17):
        with pytest.raises(ValueError):
            pow_digest(node.public_hex, "r", b"\0", log2_n)
    with pytest.raises(ValueError):
        solve_pow(node.public_hex, "r", 25, LOG2_N)


@pytest.mark.parametrize("nonce,code", [(None, "pow_required"), ("", "pow_required"), ("zz", "bad_pow"),
                                        ("00" * 33, "bad_pow"), ("00", "bad_pow")])
def test_bad_pow(nonce, code):
    node = Identity.generate()
    if nonce == "00" and leading_zero_bits(pow_digest(node.public_hex, "r", b"\0", LOG2_N)) >= 16:
        pytest.skip("this random key happens to accept nonce 00")
    with pytest.raises(AdmissionError) as e:
        check_pow(node.public_hex, "r", nonce, 16, LOG2_N)
    assert e.value.code == code


def test_pow_off_accepts_anything():
    check_pow(Identity.generate().public_hex, "r", None, 0, LOG2_N)


def test_join_tokens():
    coord, node, other = Identity.generate(), Identity.generate(), Identity.generate()
    now = 1_000_000
    any_key = make_join_token(coord, "run-a", now + 60_000)
    check_join_token(any_key, coordinator_key=coord.public_hex, run_id="run-a", node_id=node.public_hex, now_ms=now)
    for_node = make_join_token(coord, "run-a", now + 60_000, node_id=node.public_hex)
    check_join_token(for_node, coordinator_key=coord.public_hex, run_id="run-a", node_id=node.public_hex, now_ms=now)

    def code(token, **kw):
        args = dict(coordinator_key=coord.public_hex, run_id="run-a", node_id=node.public_hex, now_ms=now)
        args.update(kw)
        with pytest.raises(AdmissionError) as e:
            check_join_token(token, **args)
        return e.value.code

    assert code(None) == "token_required"
    assert code(any_key, now_ms=now + 60_000) == "token_expired"
    assert code(any_key, run_id="run-b") == "bad_token"
    assert code(for_node, node_id=other.public_hex) == "bad_token"
    assert code(make_join_token(other, "run-a", now + 60_000)) == "bad_token"  # not signed by the coordinator
    assert code("!!" + any_key) == "bad_token"
    assert code("x" * 5000) == "bad_token"
    tampered = make_join_token(coord, "run-a", now + 60_000).replace("A", "B", 1)
    assert code(tampered) == "bad_token"


def test_a_join_token_has_one_spelling_and_one_identity():
    import base64
    import hashlib
    import json

    coord, node = Identity.generate(), Identity.generate()
    now = 1_000_000
    token = make_join_token(coord, "run-a", now + 60_000)
    args = dict(coordinator_key=coord.public_hex, run_id="run-a", node_id=node.public_hex, now_ms=now)
    assert check_join_token(token, **args) == hashlib.sha256(token.encode()).hexdigest()
    doc = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    for other in (json.dumps(doc, indent=2), json.dumps({**doc, "signature": doc["signature"].upper()})):
        spelled = base64.urlsafe_b64encode(other.encode()).decode()
        with pytest.raises(AdmissionError) as e:
            check_join_token(spelled, **args)
        assert e.value.code == "bad_token"
