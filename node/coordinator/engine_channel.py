"""The local channel between the coordinator's API process and its engine process (`server.engine_process`,
node/coordinator/engine.py): one Unix socketpair made by the API process, carrying length-prefixed JSON
messages, each validated by the pydantic model of its `kind` (extra fields refused, sizes bounded).

The engine is our own child, but its messages are still checked like any input: a bug on one side must
surface as a clear error on the other, never as a half-applied state. Imports neither torch nor the
trainer: the API process reads this module.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from protocol.messages import ReplayVerdict

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a submission's verdicts (one per rollout) are far below it
MAX_ITEMS = 100_000  # rollouts per verdict message, batches per step, steps held
MAX_REASON_CHARS = 500  # as the supervisor's (node/coordinator/supervisor.py)
_HEADER = struct.Struct(">I")

Step = Annotated[int, Field(ge=0)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
Seconds = Annotated[float, Field(ge=0)]
Steps = Annotated[list[Step], Field(max_length=MAX_ITEMS)]
ByBatch = Annotated[dict[Step, Count], Field(max_length=MAX_ITEMS)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- API process -> engine ---------------------------------------------------------------------------------
class Init(_Msg):
    """The first message: the run's whole config (validated again there) and the coordinator's signing key,
    which the publisher signs manifests with (the socket is private to the two processes)."""
    kind: Literal["init"] = "init"
    config_json: Annotated[str, Field(max_length=4 * 1024 * 1024)]
    key_hex: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Start(_Msg):
    """Train: sent once the API process has rebuilt its scheduler from the ledger at the engine's `Ready`
    step, so that no step published after it is counted twice."""
    kind: Literal["start"] = "start"


class Verify(_Msg):
    """Replay the undecided groups of `assignment_id` against step `step`'s weights (VerdictQueue's draw
    chose it)."""
    kind: Literal["verify"] = "verify"
    request_id: Count
    assignment_id: Annotated[str, Field(min_length=1, max_length=128)]
    step: Step
    audit: bool = False  # the stale-step audit's replay against the step before the claimed one


class Decided(_Msg):
    """A verdict was recorded: it may complete the batch the trainer waits for."""
    kind: Literal["decided"] = "decided"


class Stop(_Msg):
    kind: Literal["stop"] = "stop"


# -- engine -> API process ---------------------------------------------------------------------------------
class Ready(_Msg):
    """Restored from the ledger (or θ_0 published): the newest published step and the steps whose weights
    the engine holds for replays."""
    kind: Literal["ready"] = "ready"
    published_step: Step
    held: Steps


class Published(_Msg):
    """The ledger committed `step`; `consumed`: groups it trained on, by batch."""
    kind: Literal["published"] = "published"
    step: Step
    consumed: ByBatch
    held: Steps


class Dropped(_Msg):
    """Groups dropped (stale, filtered), by batch: the scheduler hands their places out again."""
    kind: Literal["dropped"] = "dropped"
    by_batch: ByBatch
    keep_rate: Annotated[float, Field(ge=0, le=1)]


class Snapshot(_Msg):
    """node/coordinator/status.py's TrainerSnapshot, about once a second and after each step."""
    kind: Literal["snapshot"] = "snapshot"
    busy: bool
    busy_seconds: Seconds
    idle_seconds: Seconds
    error: Annotated[str, Field(max_length=MAX_REASON_CHARS)] | None
    last_metrics: Annotated[dict, Field(max_length=1000)]
    batch_health: Annotated[dict, Field(max_length=1000)]
    eval_curve: Annotated[list[dict], Field(max_length=MAX_ITEMS)] | None


class Verdicts(_Msg):
    """The answer to `Verify`: per rollout, (prompt_id, sample_index) and its verdict; `refs` None: the
    step's weights are no longer held; `error`: the replay raised (the submission stays undecided)."""
    kind: Literal["verdicts"] = "verdicts"
    request_id: Count
    refs: Annotated[list[tuple[Annotated[str, Field(max_length=128)], Count]], Field(max_length=MAX_ITEMS)] | None
    verdicts: Annotated[list[ReplayVerdict], Field(max_length=MAX_ITEMS)] = []
    error: Annotated[str, Field(max_length=MAX_REASON_CHARS)] | None = None


class Failed(_Msg):
    """The engine cannot go on (its training thread died): it exits after this."""
    kind: Literal["failed"] = "failed"
    component: Annotated[str, Field(max_length=64)]
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)]


ToEngine = Annotated[Union[Init, Start, Verify, Decided, Stop], Field(discriminator="kind")]
FromEngine = Annotated[Union[Ready, Published, Dropped, Snapshot, Verdicts, Failed], Field(discriminator="kind")]
TO_ENGINE: TypeAdapter[ToEngine] = TypeAdapter(ToEngine)
FROM_ENGINE: TypeAdapter[FromEngine] = TypeAdapter(FromEngine)


class ChannelError(RuntimeError):
    """A frame over the size limit, or a message that does not validate."""


def frame(msg: _Msg) -> bytes:
    body = msg.model_dump_json().encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ChannelError(f"{msg.__class__.__name__} message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def _size(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_MESSAGE_BYTES:
        raise ChannelError(f"a message of {n} bytes is announced; at most {MAX_MESSAGE_BYTES}")
    return n


def _parse(adapter: TypeAdapter, body: bytes):
    try:
        return adapter.validate_json(body)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ChannelError(f"bad message on the engine channel: {str(e)[:MAX_REASON_CHARS]}") from None


class BlockingChannel:
    """The engine's end: blocking reads on one thread, sends from any thread (one at a time)."""

    def __init__(self, sock: socket.socket, incoming: TypeAdapter):
        sock.setblocking(True)
        self.sock = sock
        self._incoming = incoming
        self._send_lock = threading.Lock()

    def send(self, msg: _Msg) -> None:
        data = frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def _exactly(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self):
        """The next message; None once the other end closed (its process ended)."""
        header = self._exactly(_HEADER.size)
        if header is None:
            return None
        body = self._exactly(_size(header))
        if body is None:
            return None
        return _parse(self._incoming, body)

    def close(self) -> None:
        self.sock.close()


class AsyncChannel:
    """The API process's end, on its event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: TypeAdapter):
        self.reader, self.writer = reader, writer
        self._incoming = incoming

    @classmethod
    async def open(cls, sock: socket.socket, incoming: TypeAdapter) -> "AsyncChannel":
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer, incoming)

    async def send(self, msg: _Msg) -> None:
        self.writer.write(frame(msg))
        await self.writer.drain()

    async def recv(self):
        """The next message; None once the other end closed (its process ended)."""
        try:
            header = await self.reader.readexactly(_HEADER.size)
            body = await self.reader.readexactly(_size(header))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return _parse(self._incoming, body)

    def close(self) -> None:
        self.writer.close()
