"""The coordinator's domain says no without HTTP.

service.py and verifier_jobs.py decide whether a node may join, take work, submit or hand in verdicts; when
they refuse, they raise `Refused(code, detail)`: a code from `RefusalCode` and one human sentence. They know
nothing of status lines. app.py, next to the routes, owns the one table from code to HTTP status
(`REFUSAL_STATUS`) and turns a Refused into the JSON error body of docs/PROTOCOL.md ("HTTP API", "Errors").
A test checks that every code has a status and that no domain module raises an HTTP error itself.

Kinds of refusal, and why each gets the status it gets:
- who you are: `unknown_node`, `banned`, `not_a_verifier`, `not_your_assignment`, and admission's
  `not_allowlisted`, `token_required`, `bad_token`, `token_expired`, `token_used`, `pow_required`, `bad_pow` (403);
- what you asked for does not exist: `unknown_assignment`, `unknown_job` (404);
- it conflicts with the run's state or your own earlier requests: `stale_policy`, `unpublished_policy`,
  `policy_went_back`, `duplicate`, `expired`, `declined`, `not_your_job` (409); the node's request was
  well-formed, the run is simply not where it thinks (these were 400 `malformed` before issue #28);
- a request whose content contradicts itself: `wrong_verdict_count` (400);
- slow down: `too_many_assignments` (429), `busy` (503, with a retry hint).
"""
from __future__ import annotations

from typing import Literal, get_args

RefusalCode = Literal[
    "unknown_node", "banned", "not_a_verifier", "not_your_assignment",
    # admission (protocol/admission.py's AdmissionError codes)
    "not_allowlisted", "token_required", "bad_token", "token_expired", "token_used", "pow_required", "bad_pow",
    "unknown_assignment", "unknown_job",
    "stale_policy", "unpublished_policy", "policy_went_back", "duplicate", "expired", "declined", "not_your_job",
    "wrong_verdict_count",
    "too_many_assignments", "busy",
]
REFUSAL_CODES: frozenset[str] = frozenset(get_args(RefusalCode))


class Refused(Exception):
    """A refusal for the requester: `code` (RefusalCode), one sentence of `detail`, and for a refusal that
    passes, when to try again (`retry_after_s`)."""

    def __init__(self, code: RefusalCode, detail: str, *, retry_after_s: int | None = None):
        if code not in REFUSAL_CODES:  # a code nobody mapped to a status is a bug here, not the client's
            raise ValueError(f"unknown refusal code {code!r}")
        super().__init__(detail)
        self.code, self.detail, self.retry_after_s = code, detail, retry_after_s
