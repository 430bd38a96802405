"""The worker's HTTP client for the coordinator (and relays): signed requests, bounded reads."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from node.aio import read_bounded
from node.http import BODY_ENCODING, COMPRESS_MIN_BYTES, RETRY_AFTER_MS_HEADER, compress_body
from protocol import messages as M
from protocol.admission import solve_pow
from protocol.errors import PrimeNodeError
from protocol.identity import Identity
from protocol.signing import sign_request

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
DEFAULT_NO_WORK = M.NoWork(retry_after_ms=250)  # a 204 without a valid X-Prime-Retry-After-Ms


class CoordinatorError(PrimeNodeError):
    """The coordinator answered with an error (status + code from its JSON body)."""
    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"coordinator said {status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class Unreachable(PrimeNodeError):
    """Network failure talking to a server: retry with backoff."""


@dataclass
class HttpResult:
    status: int
    body: bytes
    retry_after_ms: str = ""  # the X-Prime-Retry-After-Ms header, as sent (/v1/work's 204, /v1/heartbeat's 200)


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole response body; Unreachable when it is larger than `limit` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise Unreachable(f"{resp.url} sent {resp.content_length} bytes, more than the {limit}-byte limit")
    data = await read_bounded(resp.content, limit)
    if data is None:
        raise Unreachable(f"{resp.url} sent more than the {limit}-byte limit")
    return data


def retry_after(r: HttpResult) -> M.NoWork | None:
    """The answer's X-Prime-Retry-After-Ms through its wire model (100 ms-120 s); None when missing or out of
    bounds: the coordinator's mistake is not worth a stop."""
    raw = r.retry_after_ms
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        return None
    try:
        return M.NoWork(retry_after_ms=int(raw))
    except ValidationError:
        return None


class CoordinatorClient:
    """Signed requests (docs/PROTOCOL.md, "Signed requests"): the run id and the admission rules come from the
    coordinator's GET /v1/status before the first signed request."""
    def __init__(self, base_url: str, identity: Identity, session: aiohttp.ClientSession):
        self.base = base_url.rstrip("/")
        self.identity = identity
        self.session = session
        self.run: M.RunInfo | None = None

    async def _request(self, method: str, path: str, body: bytes | None = None,
                       headers: dict | None = None) -> HttpResult:
        try:
            async with self.session.request(method, self.base + path, data=body, headers=headers) as resp:
                return HttpResult(resp.status, await read_limited(resp, MAX_RESPONSE_BYTES),
                                  resp.headers.get(RETRY_AFTER_MS_HEADER, ""))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise Unreachable(f"cannot reach {self.base}: {e or type(e).__name__}") from None

    async def run_info(self) -> M.RunInfo:
        """The run this coordinator serves (fetched once)."""
        if self.run is None:
            self.run = self._parse(await self._request("GET", "/v1/status"), M.RunInfo)
        return self.run

    async def _signed(self, path: str, payload: dict) -> HttpResult:
        run = await self.run_info()
        body = json.dumps(payload).encode()
        encoding = BODY_ENCODING if len(body) >= COMPRESS_MIN_BYTES and BODY_ENCODING in run.body_encodings else None
        if encoding:  # a submission: ~1.7x fewer bytes up a home uplink (node/http.py, BODY_ENCODING)
            body = await asyncio.to_thread(compress_body, body)  # ~12 ms for 1.3 MB: off the loop
        headers = sign_request(self.identity, "POST", path, body, run_id=run.run_id)  # the body as sent
        headers["Content-Type"] = "application/json"
        if encoding:
            headers["Content-Encoding"] = encoding
        return await self._request("POST", path, body, headers)

    @staticmethod
    def _error(r: HttpResult) -> CoordinatorError:
        err = M.ErrorBody.parse(r.body)
        if err is None:
            return CoordinatorError(r.status, "http_error", r.body[:200].decode(errors="replace"))
        return CoordinatorError(r.status, err.error, err.detail)

    def _parse(self, r: HttpResult, model):
        if r.status != 200:
            raise self._error(r)
        try:  # the one deserializer (size cap, bounded nesting, the wire model)
            return M.decode(model, r.body, limit=MAX_RESPONSE_BYTES)
        except M.WireError as e:
            raise Unreachable(f"coordinator sent an invalid {model.__name__}: {e}") from None

    async def join(self, info: M.NodeInfo | None = None, *, token: str | None = None) -> M.RunSpec:
        """Join the run: with the proof of work an open run asks of a new key (solved here, off the
        event loop), or with a join token for a token run."""
        run = await self.run_info()
        payload: dict = {"node": info.model_dump()} if info else {}
        if token:
            payload["token"] = token
        if run.admission.mode == "open" and run.admission.pow_bits > 0:
            payload["pow"] = await asyncio.to_thread(solve_pow, self.identity.public_hex, run.run_id,
                                                     run.admission.pow_bits, run.admission.pow_log2_n)
        return self._parse(await self._signed("/v1/join", payload), M.RunSpec)

    async def heartbeat(self, hb: M.HeartbeatRequest) -> tuple[M.HeartbeatResponse, int | None]:
        """The answer, and when the coordinator wants the next heartbeat (ms; None where it named no valid wait)."""
        r = await self._signed("/v1/heartbeat", hb.model_dump())
        answer = self._parse(r, M.HeartbeatResponse)
        told = retry_after(r)
        return answer, told.retry_after_ms if told is not None else None

    async def work(self, policy_step: int) -> M.Assignment | M.NoWork:
        """An assignment, or NoWork (204: no work right now; when to ask again, 250 ms where the coordinator named
        no valid wait). 409 raises CoordinatorError(stale_policy)."""
        r = await self._signed("/v1/work", {"policy_step": policy_step})
        if r.status == 204:
            return retry_after(r) or DEFAULT_NO_WORK
        return self._parse(r, M.Assignment)

    async def submit(self, sub: M.SubmitRequest) -> M.SubmitResponse:
        return self._parse(await self._signed("/v1/submit", sub.model_dump()), M.SubmitResponse)

    # -- the verifier pool (a `prime-node verifier` process; its key in verification.verifier_keys) --------
    async def verify_jobs(self, *, spec: bool = False) -> M.VerifyJobsResponse | None:
        """A leased replay job and/or the run facts (`spec`); None when there is no job (204)."""
        r = await self._signed("/v1/verify/jobs", {"spec": spec})
        if r.status == 204:
            return None
        return self._parse(r, M.VerifyJobsResponse)

    async def verify_verdicts(self, req: M.VerdictsRequest) -> M.VerdictsResponse:
        return self._parse(await self._signed("/v1/verify/verdicts", req.model_dump()), M.VerdictsResponse)
