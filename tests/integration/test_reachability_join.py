"""The join's dial-back through the real coordinator (aiohttp app, ledger): the RunSpec says what was reached at
the address the join came from, and the status row says whether the node is reachable."""
import asyncio
import socket

import aiohttp

from tests.integration.coordinator_harness import RawNode, running_coordinator


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_join_answers_what_the_dial_back_reached_and_status_shows_it(tmp_path):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    open_port = server.sockets[0].getsockname()[1]
    try:
        async with running_coordinator(tmp_path) as (coord, base), aiohttp.ClientSession() as s:
            reachable, natted, silent = RawNode(base, s), RawNode(base, s), RawNode(base, s)
            st, spec = await reachable.post("/v1/join", {"node": {"listen_ports": {"libp2p": open_port}}})
            assert st == 200 and spec["reachability"] == {"observed_ip": "127.0.0.1", "libp2p": True, "http": None}
            st, spec = await natted.post("/v1/join", {"node": {"listen_ports": {"libp2p": _closed_port(),
                                                                               "http": _closed_port()}}})
            assert st == 200 and spec["reachability"] == {"observed_ip": "127.0.0.1", "libp2p": False, "http": False}
            st, spec = await silent.post("/v1/join", {})
            assert st == 200 and spec["reachability"] == {"observed_ip": "127.0.0.1", "libp2p": None, "http": None}
            # ports out of bounds or unknown fields (an address to dial) are refused before anything is dialled
            st, _ = await silent.post("/v1/join", {"node": {"listen_ports": {"libp2p": 70000}}})
            assert st == 400
            st, _ = await silent.post("/v1/join", {"node": {"listen_ports": {"libp2p": 1, "host": "10.1.2.3"}}})
            assert st == 400
            for n in (reachable, natted, silent):
                await n.post("/v1/heartbeat", {})
            coord._status = None
            async with s.get(base + "/v1/status") as r:
                rows = {row["node_id"]: row["reachable"] for row in (await r.json())["nodes"]}
            assert rows == {reachable.pub: True, natted.pub: False, silent.pub: None}
    finally:
        server.close()
        await server.wait_closed()
