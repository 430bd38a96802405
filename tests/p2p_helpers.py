"""What the libp2p tests share: real hosts started and always stopped, and a bounded wait."""
from __future__ import annotations

import asyncio
import contextlib
import time

from node.p2p.announce import decode_announcement, encode_have_announcement
from node.p2p.config import P2PConfig


def p2p_config(**fields) -> P2PConfig:
    """What a test host is given (P2PNode takes its P2PConfig whole): `fields` over the defaults, listening on
    127.0.0.1 unless `listen_host` says otherwise (the config's default is every interface, which a host does
    not announce). A misspelt or out-of-bounds field fails here, as it would in a config file."""
    fields.setdefault("listen_host", "127.0.0.1")
    return P2PConfig(**fields)


@contextlib.asynccontextmanager
async def running(*nodes):
    """Start each P2PNode in order; stop them all on the way out, whatever happened."""
    try:
        for n in nodes:
            await n.start()
        yield nodes
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))


async def until(what: str, cond, deadline_s: float = 15.0):
    """Poll `cond` (a function, sync or async) every 50 ms until it returns something true (returned); fail
    with `what` after `deadline_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


def learn_have(of, at, addrs, *, run_id: str, manifest_hash: str, indices, step: int = 1) -> None:
    """`at` records the signed `have` that `of` would gossip for `indices` of `step` (the gossip path itself is
    tested elsewhere)."""
    raw = encode_have_announcement(of.identity, run_id=run_id, step=step, manifest_hash=manifest_hash,
                                   indices=list(indices), addrs=list(addrs))
    at.table.note_manifest(step, manifest_hash)
    assert at.table.record_have(of.peer_id, decode_announcement(raw, run_id=run_id, coordinator_key=None,
                                                                origin_node_id=of.node_id, max_age_s=60))
