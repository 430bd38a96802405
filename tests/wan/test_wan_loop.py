"""The whole loop across the WAN lab: a coordinator in a datacenter, a node on public fibre and two nodes at
home behind their own NAT routers (20 Mbit/s up, 20 and 50 ms one way), every process the real CLI."""
import json
import sys
import time
from pathlib import Path

import pytest

from tests.wan.lab import DATACENTER, Lab, home, public

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).resolve().parents[2]
STEPS = 4
STATUS = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/v1/status", timeout=5).read().decode())
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "node.cli", *args]


def test_loop_completes_with_homes_behind_nat(tmp_path):
    common = ["--config", str(REPO / "configs/local.toml"), "--set=trainer.warm_start_steps=0",
              "--set=eval.every_steps=0"]
    with Lab() as lab:
        dc = lab.add("dc", DATACENTER)
        nodes = [lab.add("pub", public(10.0)), lab.add("home1", home(20.0)), lab.add("home2", home(50.0))]
        ready = tmp_path / "coordinator.ready"
        coord = lab.spawn(dc, "coordinator", cli(
            "coordinator", *common, f"--set=server.host={dc.addr}", "--set=server.port=8000",
            f"--set=storage.dir={tmp_path / 'coord'}", f"--set=run.max_steps={STEPS}", f"--set=p2p.listen_host={dc.addr}",
            "--ready-file", str(ready)), cwd=REPO)
        t0 = time.monotonic()
        while not ready.is_file():
            assert coord.poll() is None, lab.log("coordinator")[-3000:]
            assert time.monotonic() - t0 < 120, "the coordinator did not start"
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        url = info["url"]
        for n in nodes:
            lab.spawn(n, f"worker-{n.name}", cli(
                "join", "--coordinator", url, "--coordinator-key", info["key"], *common,
                f"--set=worker.storage_dir={tmp_path / n.name}", "--set=worker.heartbeat_seconds=1",
                "--set=p2p.listen_host=0.0.0.0"), cwd=REPO)

        def status() -> dict:
            out = lab.run(dc, [sys.executable, "-c", STATUS, url])
            return json.loads(out.stdout) if out.returncode == 0 else {}

        deadline = time.monotonic() + 360
        s = {}
        while time.monotonic() < deadline:
            s = status()
            held = {row.get("policy_step") for row in s.get("nodes", [])}
            if s.get("step", 0) >= STEPS and len(s.get("nodes", [])) == len(nodes) and held == {STEPS}:
                break
            assert coord.poll() is None, lab.log("coordinator")[-3000:]
            time.sleep(1)
        else:
            raise AssertionError(f"not every node reached step {STEPS}: {json.dumps(s)[:3000]}")
        lab.check_delay_lines()  # the latencies held for the whole run
        assert s["verification"]["rejected"] == 0, s["verification"]
        assert s["verification"]["accepted"] > 0
        accepted = {row["node_id"][:8]: row.get("accepted") for row in s["nodes"]}
        print("accepted rollouts by node:", accepted, "bytes by source:", s.get("checkpoint_bytes_by_source"))
