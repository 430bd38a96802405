"""Reachability, tested instead of assumed (#26 item 2), across the WAN lab with real CLI processes: a coordinator
in the datacenter, a node on public fibre and a node at home behind its own NAT router, every one with the default
p2p listen host (0.0.0.0) and the HTTP data plane on. The join's dial-back tells the public node it is reachable
(it announces the address the coordinator reached) and the home that it is not (it announces nothing dialable);
after the dial-back nothing tries to connect into the home; the run completes.

`python -m tests.wan.test_wan_reachability measure` (as root) runs the same lab three ways and prints the seconds
from "step n published" to "public node holds step n": the home announcing nothing (the default), the home
announcing its router's address at a port nobody forwards (what an unverified address used to cost), and that
again with the old peer dial limits (10 s, failed dials not remembered); then, from the public node, the cost of
three fetch attempts at a holder announced at the home router's unforwarded ports (HTTP and libp2p), with the
old limits and the new ones."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.wan.lab import DATACENTER, STATUS, Lab, cli, home, json_lines, public, wait_for

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
HOME_PORT = 4001  # where the home listens when it announces its router's address (nothing forwards it)


def _home_inbound_counter(router: str) -> None:
    """Count every new connection attempt from outside at the home's router (they are all dropped)."""
    subprocess.run(["ip", "netns", "exec", router, "nft", "insert", "rule", "ip", "home", "input", "iifname", "wan",
                    "ct", "state", "new", "counter"], check=True, capture_output=True, timeout=10)


def _home_inbound(router: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", router, "nft", "list", "chain", "ip", "home", "input"],
                         capture_output=True, text=True, timeout=10).stdout
    m = re.search(r'iifname "wan" ct state new counter packets (\d+)', out)
    assert m, out
    return int(m.group(1))


def run_lab(tmp_path: Path, *, home_announces: bool = False, old_dials: bool = False) -> dict:
    """Build the lab, run STEPS steps; return what the test checks and the timings."""
    common = ["--config", str(REPO / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0", "--set=server.log_format=json"]
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        pub, hm = lab.add("pub", public(10.0)), lab.add("home", home(20.0))
        ready = tmp_path / "coordinator.ready"
        coord = lab.spawn(dc, "coordinator", cli(
            "coordinator", *common, f"--set=server.host={dc.addr}", "--set=server.port=8000",
            f"--set=storage.dir={tmp_path / 'coord'}", f"--set=run.max_steps={STEPS}", "--ready-file", str(ready)),
            cwd=REPO)

        def coordinator_alive():
            assert coord.poll() is None, lab.log("coordinator")[-3000:]

        wait_for("the coordinator", ready.is_file, 120, coordinator_alive, every_s=0.2)
        info = json.loads(ready.read_text())
        url = info["url"]
        node_args = ["--coordinator", url, "--coordinator-key", info["key"], *common, "--set=worker.heartbeat_seconds=1",
                     "--set=p2p.http=true"]
        extra = {"pub": [], "home": []}
        if home_announces:  # an address nobody checked: the home's router, at a port it does not forward
            extra["home"] = [f"--set=p2p.listen_port={HOME_PORT}",
                             f'--set=p2p.announce_addrs=["/ip4/{hm.public_addr}/tcp/{HOME_PORT}"]']
        if old_dials:
            extra["pub"] = ["--set=p2p.dial_timeout_s=10", "--set=p2p.dial_retry_s=0"]
        for site in (pub, hm):
            lab.spawn(site, f"worker-{site.name}", cli("join", *node_args, f"--set=worker.storage_dir={tmp_path / site.name}",
                                                       *extra[site.name]), cwd=REPO)

        def reach_line(name: str):
            return next((r["msg"] for r in json_lines(lab.log(f"worker-{name}")) if "reachable at" in r["msg"]), None)

        pub_line = wait_for("the public node's reachability", lambda: reach_line("pub"), 120, coordinator_alive, every_s=0.2)
        home_line = wait_for("the home's reachability", lambda: reach_line("home"), 120, coordinator_alive, every_s=0.2)
        _home_inbound_counter(hm.router)  # from here on, nothing may try to connect into the home

        def status() -> dict:
            out = lab.run(dc, [sys.executable, "-c", STATUS, url])
            return json.loads(out.stdout) if out.returncode == 0 else {}

        def done():
            s = status()
            rows = s.get("nodes", [])
            return s if (s.get("step", 0) >= STEPS and len(rows) == 2
                         and {r.get("policy_step") for r in rows} == {STEPS}) else None

        s = wait_for(f"every node at step {STEPS}", done, 240, coordinator_alive, every_s=0.2)
        inbound = _home_inbound(hm.router)
        published = {int(m.group(1)): r["ts"] for r in json_lines(lab.log("coordinator"))
                     if (m := re.match(r"step (\d+) published", r["msg"]))}
        held = {int(m.group(1)): r["ts"] for r in json_lines(lab.log("worker-pub"))
                if (m := re.match(r"holding step (\d+)", r["msg"]))}
        dialbacks = [r["msg"] for r in json_lines(lab.log("coordinator")) if r["msg"].startswith("join of ")]
        lag = {n: round(held[n] - published[n], 2) for n in sorted(held) if n in published}
        return {"status": s, "pub_line": pub_line, "home_line": home_line, "inbound": inbound, "lag": lag,
                "dialbacks": dialbacks, "pub": pub, "home": hm}


def test_public_node_is_told_reachable_the_home_is_not_and_nothing_dials_into_the_home(tmp_path):
    r = run_lab(tmp_path)
    print("dial-backs:", *r["dialbacks"], sep="\n  ")
    print("public node:", r["pub_line"], "\nhome:", r["home_line"], "\nseconds from publish to held (public):", r["lag"])
    pub, hm = r["pub"], r["home"]
    assert f"reachable at {pub.public_addr} (libp2p True, HTTP True)" in r["pub_line"]
    assert f"/ip4/{pub.public_addr}/tcp/" in r["pub_line"]  # it announces the address the coordinator reached
    assert f"NOT reachable at {hm.public_addr}" in r["home_line"]  # the router's address, not 192.168.x
    assert "announcing no address" in r["home_line"]
    rows = {row["node_id"]: row["reachable"] for row in r["status"]["nodes"]}
    assert sorted(rows.values(), key=str) == [False, True], rows
    assert r["inbound"] == 0, f"{r['inbound']} connection attempts into the home after its dial-back"
    assert r["status"]["verification"]["rejected"] == 0 and r["status"]["verification"]["accepted"] > 0


async def _attempts(dial_timeout_s: float, dial_retry_s: float, home_ip: str) -> str:
    """Three fetches from a holder whose announced addresses nobody answers; the seconds each took."""
    from node.p2p import P2PNode
    from node.p2p.announce import decode_announcement, encode_have_announcement
    from node.p2p.config import P2PConfig
    from protocol.identity import Identity

    h = "ab" * 32
    me = P2PNode(Identity.generate(), P2PConfig(http=True, allow_private_addrs=True, dial_timeout_s=dial_timeout_s,
                                                dial_retry_s=dial_retry_s, connect_timeout_s=10), run_id="r")
    await me.start()
    home_key = Identity.generate()
    peer = P2PNode(home_key, P2PConfig(), run_id="r").peer_id
    me.table.note_manifest(1, h)
    raw = encode_have_announcement(home_key, run_id="r", step=1, manifest_hash=h, indices=[0, 1, 2],
                                   addrs=[f"/ip4/{home_ip}/tcp/{HOME_PORT}/p2p/{peer}", f"/ip4/{home_ip}/tcp/4002/http"])
    me.table.record_have(peer, decode_announcement(raw, run_id="r", coordinator_key=None,
                                                   origin_node_id=home_key.node_id, max_age_s=60))
    took = []
    for i in range(3):
        t0 = time.monotonic()
        try:
            await me.fetch_shard(peer, 1, i, 1 << 20, manifest_hash=h)
            what = "served?!"
        except Exception as e:
            what = type(e).__name__
        took.append(f"{time.monotonic() - t0:.2f} s ({what})")
    await me.stop()
    return ", ".join(took)


if __name__ == "__main__" and sys.argv[1:2] == ["attempts"]:
    import asyncio

    print(asyncio.run(_attempts(float(sys.argv[2]), float(sys.argv[3]), sys.argv[4])))

if __name__ == "__main__" and sys.argv[1:] == ["measure"]:
    import tempfile

    with Lab() as lab:
        pub, hm = lab.add("pub", public(10.0)), lab.add("home", home(20.0))
        for label, args in (("old limits (10 s, not remembered)", ["10", "0"]), ("new (3 s, remembered 60 s)", ["3", "60"])):
            r = lab.run(pub, [sys.executable, "-m", "tests.wan.test_wan_reachability", "attempts", *args,
                              hm.public_addr], timeout=120)
            print(f"fetch attempts at an unanswered announced address, {label}: {r.stdout.strip()} {r.stderr[-300:]}",
                  flush=True)

    for label, kw in (("home announces nothing (default)", {}),
                      ("home announces an unforwarded router port", {"home_announces": True}),
                      ("same, old dial limits (10 s, no memory)", {"home_announces": True, "old_dials": True})):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.monotonic()
            r = run_lab(Path(d), **kw)
            print(f"{label}: publish->held on the public node {r['lag']} s; inbound into home {r['inbound']}; "
                  f"run {time.monotonic() - t0:.0f} s", flush=True)
            print("  ", *r["dialbacks"], sep="\n   ")
