"""The worker's HTTP client for the coordinator (and relays): signed requests, bounded reads."""
from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp

from node.aio import read_bounded
from protocol import messages as M
from protocol.errors import PrimeNodeError
from protocol.identity import Identity
from protocol.signing import sign_request

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 8 * 1024 * 1024


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


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole response body; Unreachable when it is larger than `limit` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise Unreachable(f"{resp.url} sent {resp.content_length} bytes, more than the {limit}-byte limit")
    data = await read_bounded(resp.content, limit)
    if data is None:
        raise Unreachable(f"{resp.url} sent more than the {limit}-byte limit")
    return data


class CoordinatorClient:
    def __init__(self, base_url: str, identity: Identity, session: aiohttp.ClientSession):
        self.base = base_url.rstrip("/")
        self.identity = identity
        self.session = session

    async def _signed(self, path: str, payload: dict) -> HttpResult:
        body = json.dumps(payload).encode()
        headers = sign_request(self.identity, "POST", path, body)
        headers["Content-Type"] = "application/json"
        try:
            async with self.session.post(self.base + path, data=body, headers=headers) as resp:
                return HttpResult(resp.status, await read_limited(resp, MAX_RESPONSE_BYTES))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise Unreachable(f"cannot reach {self.base}: {e or type(e).__name__}") from None

    @staticmethod
    def _error(r: HttpResult) -> CoordinatorError:
        try:
            body = json.loads(r.body)
            return CoordinatorError(r.status, str(body.get("error")), str(body.get("detail")))
        except (ValueError, AttributeError):
            return CoordinatorError(r.status, "http_error", r.body[:200].decode(errors="replace"))

    def _parse(self, r: HttpResult, model):
        if r.status != 200:
            raise self._error(r)
        try:
            return model.model_validate_json(r.body)
        except ValueError as e:
            raise Unreachable(f"coordinator sent an invalid {model.__name__}: {e}") from None

    async def join(self, info: M.NodeInfo | None = None) -> M.RunSpec:
        payload = {"node": info.model_dump()} if info else {}
        return self._parse(await self._signed("/v1/join", payload), M.RunSpec)

    async def heartbeat(self, hb: M.HeartbeatRequest) -> M.HeartbeatResponse:
        return self._parse(await self._signed("/v1/heartbeat", hb.model_dump()), M.HeartbeatResponse)

    async def work(self, policy_step: int) -> M.Assignment | None:
        """An assignment, or None (204: no work right now). 409 raises CoordinatorError(stale_policy)."""
        r = await self._signed("/v1/work", {"policy_step": policy_step})
        if r.status == 204:
            return None
        return self._parse(r, M.Assignment)

    async def submit(self, sub: M.SubmitRequest) -> M.SubmitResponse:
        return self._parse(await self._signed("/v1/submit", sub.model_dump()), M.SubmitResponse)
