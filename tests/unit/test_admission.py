"""Admission primitives (DESIGN §4): proof of work bound to key and run, join tokens signed by the
coordinator with expiry."""
import pytest

from protocol.admission import (AdmissionError, check_join_token, check_pow, leading_zero_bits, make_join_token,
                                pow_digest, solve_pow)
from protocol.identity import Identity


def test_pow_is_bound_to_the_key_and_the_run():
    node = Identity.generate()
    nonce = solve_pow(node.public_hex, "run-a", 12)
    check_pow(node.public_hex, "run-a", nonce, 12)
    assert leading_zero_bits(pow_digest(node.public_hex, "run-a", bytes.fromhex(nonce))) >= 12
    # worth nothing for another key or another run (2**-12 chance each of being valid by luck)
    other = Identity.generate()
    for key, run in ((other.public_hex, "run-a"), (node.public_hex, "run-b")):
        if leading_zero_bits(pow_digest(key, run, bytes.fromhex(nonce))) < 12:
            with pytest.raises(AdmissionError) as e:
                check_pow(key, run, nonce, 12)
            assert e.value.code == "bad_pow"


@pytest.mark.parametrize("nonce,code", [(None, "pow_required"), ("", "pow_required"), ("zz", "bad_pow"),
                                        ("00" * 33, "bad_pow"), ("00", "bad_pow")])
def test_bad_pow(nonce, code):
    node = Identity.generate()
    if nonce == "00" and leading_zero_bits(pow_digest(node.public_hex, "r", b"\0")) >= 16:
        pytest.skip("this random key happens to accept nonce 00")
    with pytest.raises(AdmissionError) as e:
        check_pow(node.public_hex, "r", nonce, 16)
    assert e.value.code == code


def test_pow_off_accepts_anything():
    check_pow(Identity.generate().public_hex, "r", None, 0)


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
