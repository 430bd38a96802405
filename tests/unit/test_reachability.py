"""The pure parts of reachability (#26 item 2): the coordinator's dial-back (real sockets on loopback), what a
node announces after it, how holders are ranked, and super-seeding's first copies going to reachable nodes."""
import asyncio
import socket
import time

import pytest

from node.coordinator.reachability import DialBack, NodeReach, observed_ip, tcp_connects
from node.coordinator.seeding import SuperSeeder
from node.p2p.announce import encode_have_announcement, decode_announcement
from node.p2p.host import P2PNode
from protocol import messages as M
from protocol.identity import Identity
from tests.p2p_helpers import p2p_config

H = "ab" * 32


async def _listener(host: str = "127.0.0.1"):
    """A TCP server that counts connections; returns (server, port, accepted list)."""
    accepted = []

    async def on_conn(reader, writer):
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_conn, host, 0)
    return server, server.sockets[0].getsockname()[1], accepted


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


async def test_dial_back_tells_an_open_port_from_a_closed_one():
    server, port, accepted = await _listener()
    try:
        dial = DialBack(allow_private=True, timeout_s=3.0)
        t0 = time.monotonic()
        r = await dial.check("n1", "127.0.0.1", M.ListenPorts(libp2p=port, http=_closed_port()))
        took = time.monotonic() - t0
    finally:
        server.close()
        await server.wait_closed()
    assert r == M.Reachability(observed_ip="127.0.0.1", libp2p=True, http=False)
    assert len(accepted) == 1 and took < 1.0
    assert dial.reachable("n1") is True and dial.reachable("unknown") is None


async def test_dial_back_only_ever_dials_the_observed_ip():
    """A node cannot point the dial-back elsewhere: only ports travel in the join, and the address dialled is
    the one the request came from. Something listens at 127.0.0.2:P; a join from 127.0.0.1 listing port P (and
    naming 127.0.0.2 in its p2p_addrs) is dialled at 127.0.0.1:P, where nothing listens, and 127.0.0.2 sees
    no connection."""
    server, port, accepted = await _listener("127.0.0.2")
    try:
        info = M.NodeInfo(p2p_addrs=[f"/ip4/127.0.0.2/tcp/{port}"], listen_ports=M.ListenPorts(libp2p=port))
        r = await DialBack(allow_private=True).check("n1", "127.0.0.1", info.listen_ports)
    finally:
        server.close()
        await server.wait_closed()
    assert r.observed_ip == "127.0.0.1" and r.libp2p is False
    assert accepted == []
    with pytest.raises(ValueError):  # the wire carries ports, and bounded ones
        M.ListenPorts(libp2p=0)
    with pytest.raises(ValueError):
        M.ListenPorts.model_validate({"libp2p": 4001, "host": "10.0.0.1"})


async def test_dial_back_is_rate_limited_per_address_and_follows_the_address_policy():
    dialled = []

    async def connect(ip, port, timeout_s):  # the real connect, recording where it went
        dialled.append((ip, port))
        return await tcp_connects(ip, port, timeout_s)

    server, port, _ = await _listener()
    try:
        dial = DialBack(allow_private=True, per_minute=2, connect=connect)
        first = await dial.check("a", "127.0.0.1", M.ListenPorts(libp2p=port, http=port))
        second = await dial.check("b", "127.0.0.1", M.ListenPorts(libp2p=port))
        public_only = DialBack(allow_private=False, connect=connect)
        private = await public_only.check("c", "127.0.0.1", M.ListenPorts(libp2p=port))
    finally:
        server.close()
        await server.wait_closed()
    assert (first.libp2p, first.http) == (True, True)
    assert second.libp2p is None  # over the limit: not tried
    assert private.libp2p is None  # loopback is not dialled on the open internet
    assert dialled == [("127.0.0.1", port), ("127.0.0.1", port)]


def test_observed_ip_and_verified_http_addr():
    assert observed_ip("::ffff:8.8.8.8") == "8.8.8.8"
    assert observed_ip("2001:db8::1") == "2001:db8::1"
    assert observed_ip("not an ip") is None and observed_ip(None) is None
    dial = DialBack()
    dial._remember("n", NodeReach("8.8.8.8", False, True, 8080))
    assert dial.http_addr_verified("n", "/ip4/8.8.8.8/tcp/8080/http")
    assert not dial.http_addr_verified("n", "/ip4/8.8.8.8/tcp/8081/http")
    assert not dial.http_addr_verified("n", "/ip4/198.51.100.1/tcp/8080/http")
    assert not dial.http_addr_verified("other", "/ip4/8.8.8.8/tcp/8080/http")


def _node(allow_private: bool = False, **settings) -> P2PNode:
    node = P2PNode(Identity.generate(), p2p_config(allow_private_addrs=allow_private, **settings), run_id="r")
    node.listen_addrs = [f"/ip4/0.0.0.0/tcp/4001/p2p/{node.peer_id}"]  # as after start() on a wildcard
    node.announce_addrs = node._addrs_to_announce()
    return node


def test_a_node_announces_only_what_was_dialled_back():
    node = _node()
    assert node.announce_addrs == []  # a wildcard is nothing a peer can dial
    node._http_server, node._http_port_bound = object(), 8080
    assert node.apply_reachability("8.8.8.8", True, True) == [
        f"/ip4/8.8.8.8/tcp/4001/p2p/{node.peer_id}", "/ip4/8.8.8.8/tcp/8080/http"]
    assert node.reachable is True
    assert node.apply_reachability("8.8.8.8", True, False) == [f"/ip4/8.8.8.8/tcp/4001/p2p/{node.peer_id}"]
    assert node.apply_reachability("8.8.8.8", False, False) == [] and node.reachable is False
    # never a private or loopback address on the open internet, even if the coordinator reached it
    assert _node().apply_reachability("192.168.1.5", True, None) == []
    assert _node(allow_private=True).apply_reachability("192.168.1.5", True, None)[0].startswith("/ip4/192.168.1.5/")
    # an operator's announce_addrs stay (port forwarding to other ports is the operator's word)
    fixed = _node(announce_addrs=["/ip4/8.8.4.4/tcp/5000"])
    assert fixed.apply_reachability("8.8.8.8", False, None) == [f"/ip4/8.8.4.4/tcp/5000/p2p/{fixed.peer_id}"]


def test_reachable_holders_rank_first_and_failed_dials_last():
    me = _node(allow_private=True)
    me.table.note_manifest(3, H)
    peers = {name: Identity.generate() for name in ("natted", "public", "failed")}
    pid = {}
    for name, ident in peers.items():  # oldest announcer first: newest-first order would be failed, public, natted
        addrs = [] if name == "natted" else [f"/ip4/10.0.0.{len(pid) + 1}/tcp/4001"]
        raw = encode_have_announcement(ident, run_id="r", step=3, manifest_hash=H, indices=[0], addrs=addrs)
        pid[name] = P2PNode(ident, p2p_config(), run_id="r").peer_id
        ann = decode_announcement(raw, run_id="r", coordinator_key=None, origin_node_id=ident.node_id, max_age_s=60)
        assert me.table.record_have(pid[name], ann)
    assert me.peers_with(3, 0, H) == [pid["failed"], pid["public"], pid["natted"]]
    me._note_dial_failed(pid["failed"])
    assert me.peers_with(3, 0, H) == [pid["public"], pid["natted"], pid["failed"]]
    me.cfg.dial_retry_s = 0.0  # remembered only for a while
    assert me.peers_with(3, 0, H)[0] == pid["failed"]


def test_first_copies_go_only_to_reachable_nodes():
    reach = {"home": False, "pub": True}
    t = [0.0]
    seeder = SuperSeeder(2.0, clock=lambda: t[0], reachable=lambda n: reach.get(n))
    key = (1, 0)
    assert seeder.admit(key, "home")
    seeder.started(key, "home")
    seeder.finished(key, "home")
    assert seeder.holder(key) is None  # a NATed node holds no claim: nobody is deferred to it
    assert seeder.admit(key, "pub")
    seeder.started(key, "pub")
    seeder.finished(key, "pub")
    assert seeder.holder(key) == "pub"
    assert not seeder.admit(key, "home")  # deferred to the reachable holder
    assert seeder.admit((1, 1), "unknown")
    seeder.started((1, 1), "unknown")  # not dialled back (older node, limit): counted as before
    assert seeder.holder((1, 1)) is None and seeder._claims[(1, 1)].node_id == "unknown"
