"""The coordinator's domain refuses without HTTP (node/coordinator/refusals.py; issue #28): only app.py, beside
the routes, knows status lines, and its table covers every refusal code."""
import ast
from pathlib import Path

import pytest

from node.coordinator.app import REFUSAL_STATUS
from node.coordinator.refusals import REFUSAL_CODES, Refused
from protocol.admission import AdmissionError

REPO = Path(__file__).resolve().parents[2]
# Modules that handle aiohttp requests themselves (routes, and the checkpoint route's seeding gate, which reads
# the request's headers) may answer in HTTP; the rest of the coordinator is the domain.
HTTP_SIDE = {"app.py", "seeding.py", "openapi.py"}


def test_every_refusal_code_has_exactly_one_status():
    assert set(REFUSAL_STATUS) == REFUSAL_CODES
    assert all(400 <= s < 600 for s in REFUSAL_STATUS.values())


def test_admission_codes_are_refusal_codes():
    """service._admit passes AdmissionError's code through as a refusal: every code it can carry is mapped."""
    src = (REPO / "protocol" / "admission.py").read_text() + (REPO / "node/coordinator/service.py").read_text()
    codes = {n.args[0].value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "AdmissionError" and n.args and isinstance(n.args[0], ast.Constant)}
    assert codes and codes <= REFUSAL_CODES, codes - REFUSAL_CODES
    assert issubclass(AdmissionError, Exception)


def test_an_unmapped_code_is_a_bug_caught_where_it_is_raised():
    with pytest.raises(ValueError, match="unknown refusal code"):
        Refused("not_a_code", "x")  # type: ignore[arg-type]


def test_no_domain_module_speaks_http():
    """Before issue #28 service.py raised 14 ApiError(403/409/429...) and verifier_jobs.py 4 more."""
    offenders = []
    for path in sorted((REPO / "node" / "coordinator").glob("*.py")):
        if path.name in HTTP_SIDE:
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module in ("node.http", "aiohttp") and any(
                    a.name in ("ApiError", "web", "json_error") for a in n.names):
                offenders.append(f"{path.name}:{n.lineno} imports {[a.name for a in n.names]} from {n.module}")
            if isinstance(n, ast.Import) and any(a.name.startswith("aiohttp") for a in n.names):
                offenders.append(f"{path.name}:{n.lineno} imports aiohttp")
    assert not offenders, offenders
