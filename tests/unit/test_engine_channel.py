"""The engine channel (node/coordinator/engine_channel.py): length-prefixed JSON over a real socketpair, each
message validated by its model; oversized frames, unknown kinds and extra fields are refused, and a closed
end reads as None (the other process is gone)."""
import asyncio
import socket
import struct

import pytest

from node.coordinator import engine_channel as C
from protocol.messages import ReplayVerdict


def pair():
    a, b = socket.socketpair()
    return C.BlockingChannel(a, C.FROM_ENGINE), C.BlockingChannel(b, C.TO_ENGINE)


def test_messages_cross_both_ways_and_a_closed_end_reads_none():
    api, engine = pair()
    engine_msgs = [C.Ready(published_step=3, held=[1, 2, 3]),
                   C.Published(step=4, consumed={3: 2, 4: 2}, held=[2, 3, 4]),
                   C.Verdicts(request_id=7, refs=[("0:p", 1)], verdicts=[ReplayVerdict(reason="verify_logprobs",
                                                                                          tokens=5, near_ties=0)])]
    for m in engine_msgs:
        engine.send(m)
    assert [api.recv() for _ in engine_msgs] == engine_msgs
    api.send(C.Verify(request_id=7, assignment_id="a1", step=4))
    assert engine.recv() == C.Verify(request_id=7, assignment_id="a1", step=4)
    engine.close()
    assert api.recv() is None


@pytest.mark.parametrize("body", [
    b'{"kind": "ready", "published_step": 1, "held": [], "extra": 1}',  # extra field
    b'{"kind": "shell", "cmd": "rm -rf /"}',  # unknown kind
    b'{"kind": "ready", "published_step": -1, "held": []}',  # out of bounds
    b'not json',
])
def test_a_bad_message_is_refused(body):
    a, b = socket.socketpair()
    api = C.BlockingChannel(a, C.FROM_ENGINE)
    b.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(C.ChannelError):
        api.recv()


def test_an_oversized_frame_is_refused_before_it_is_read():
    a, b = socket.socketpair()
    api = C.BlockingChannel(a, C.FROM_ENGINE)
    b.sendall(struct.pack(">I", C.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(C.ChannelError, match="announced"):
        api.recv()


def test_the_async_end_reads_what_the_blocking_end_sends():
    async def main():
        a, b = socket.socketpair()
        engine = C.BlockingChannel(b, C.TO_ENGINE)
        api = await C.AsyncChannel.open(a, C.FROM_ENGINE)
        await api.send(C.Start())
        assert engine.recv() == C.Start()
        engine.send(C.Failed(component="trainer", reason="RuntimeError: boom"))
        assert await api.recv() == C.Failed(component="trainer", reason="RuntimeError: boom")
        engine.close()
        assert await api.recv() is None
        api.close()

    asyncio.run(main())
