"""The WAN lab: sites in network namespaces around one core router, with home NAT, shaped links and latency.

    core ──c1── dc   (10.77.1.2)                       the coordinator, relays: ~no delay, 1 Gbit/s
         ──c2── public (10.77.2.2)                     a node on fibre: 5-20 ms one way, 200/200 Mbit/s
         ──c3── router (10.77.3.2, NAT) ──lan── home (192.168.3.2)
                                                       a node at home: 20-100 ms one way, 20 up / 100 down

Every site hangs off the core namespace on its own veth pair (its "line"); site i's line is 10.77.i.0/24
(core .1, site .2). A home's line ends at its own router namespace, which masquerades the home's private
network behind 10.77.i.2 and drops every new connection from outside (a typical home router: nothing dials
in, homes cannot reach each other's private addresses) except to the ports it forwards (`Profile.forward`).
A line's uplink is a tbf at the site's end, its downlink a tbf at the core's end. Latency comes from a delay
line (tests/wan/delay_line.py, NFQUEUE; this kernel has no netem) in the core, one per site: a packet waits
its source site's delay on the way in and its destination site's on the way out, so the round trip between
sites A and B is 2 * (delay A + delay B).

All addresses exist only inside the namespaces the lab made (named pnl<pid>-...); the root namespace is never
touched. `Lab` is a context manager: on exit it stops every process it started (TERM, then KILL), kills
whatever else is left in its namespaces, and deletes them (their veths go with them). Labs left by a killed
run (their creator pid is gone) are removed by the next one. `unavailable()` says in one line why a lab
cannot be built here (not root, no `ip netns`, no nftables/iptables, no NFQUEUE), for a skip.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DELAY_LINE = Path(__file__).with_name("delay_line.py")
PREFIX = "pnl"
LAB_SYSCTLS_ENV = "PRIME_WAN_LAB_SYSCTLS"  # space-separated KEY=VALUE sysctls for every namespace (Lab._netns)

Kind = Literal["dc", "public", "home"]


@dataclass(frozen=True)
class Profile:
    kind: Kind
    one_way_ms: float  # between the site and the core, each way
    up: str  # tc rates: "20mbit", "1gbit"
    down: str
    # a home router's port forwards: TCP ports on its public address that reach the home (DNAT), as a user
    # who forwarded the node's port would set; the home's node must listen on them (p2p.listen_port)
    forward: tuple[int, ...] = ()


DATACENTER = Profile("dc", 0.0, "1gbit", "1gbit")


def public(one_way_ms: float = 10.0) -> Profile:
    return Profile("public", one_way_ms, "200mbit", "200mbit")


def home(one_way_ms: float = 40.0, up: str = "20mbit", down: str = "100mbit",
         forward: tuple[int, ...] = ()) -> Profile:
    return Profile("home", one_way_ms, up, down, forward)


@dataclass
class Site:
    index: int
    name: str
    profile: Profile
    ns: str  # where the site's processes run
    router: str | None  # a home's NAT router namespace
    addr: str  # the site's own address (a home's private one)
    public_addr: str  # what others see (a home's router)


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    logs: Path = field(default_factory=lambda: Path("/tmp") / f"{PREFIX}{os.getpid()}")
    sites: list[Site] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _delay_lines: dict[str, subprocess.Popen] = field(default_factory=dict)  # site name -> its delay line
    _namespaces: list[str] = field(default_factory=list)

    # -- building ------------------------------------------------------------------------------------
    def __enter__(self) -> "Lab":
        remove_stale_labs()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.core = self._netns("core")
        _sh("ip", "netns", "exec", self.core, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, name: str, profile: Profile) -> Site:
        """A new site on its own line to the core: shaped, delayed and (for a home) behind its own NAT."""
        i = len(self.sites) + 1
        if i > 250:
            raise ValueError("at most 250 sites in one lab")
        ns = self._netns(f"s{i}")
        line_core, line_site = f"10.77.{i}.1", f"10.77.{i}.2"
        router = None
        if profile.kind == "home":
            router = self._netns(f"r{i}")
            self._veth(self.core, f"c{i}", router, "wan")
            self._addr(self.core, f"c{i}", f"{line_core}/24")
            self._addr(router, "wan", f"{line_site}/24")
            self._veth(router, "lan", ns, "e0")
            self._addr(router, "lan", f"192.168.{i}.1/24")
            self._addr(ns, "e0", f"192.168.{i}.2/24")
            _sh("ip", "netns", "exec", router, "ip", "route", "add", "default", "via", line_core)
            _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", f"192.168.{i}.1")
            _sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _sh("ip", "netns", "exec", router, "nft", "-f", "-", input=_HOME_ROUTER_RULES)
            if profile.forward:
                _sh("ip", "netns", "exec", router, "nft", "-f", "-",
                    input=_port_forward_rules(profile.forward, f"192.168.{i}.2"))
            uplink_at, addr = (router, "wan"), f"192.168.{i}.2"
        else:
            self._veth(self.core, f"c{i}", ns, "e0")
            self._addr(self.core, f"c{i}", f"{line_core}/24")
            self._addr(ns, "e0", f"{line_site}/24")
            _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", line_core)
            uplink_at, addr = (ns, "e0"), line_site
        _tbf(*uplink_at, profile.up)
        _tbf(self.core, f"c{i}", profile.down)
        if profile.one_way_ms > 0:
            for chain, flag in (("PREROUTING", "-i"), ("POSTROUTING", "-o")):
                _sh("ip", "netns", "exec", self.core, "iptables", "-t", "mangle", "-A", chain, flag, f"c{i}",
                    "-j", "NFQUEUE", "--queue-num", str(i), "--queue-bypass")
            self._delay_lines[name] = self.spawn_in(
                self.core, f"delay-{name}",
                [sys.executable, str(DELAY_LINE), "--queue", str(i), "--delay-ms", str(profile.one_way_ms)])
        site = Site(i, name, profile, ns, router, addr, line_site)
        self.sites.append(site)
        return site

    def _netns(self, suffix: str) -> str:
        name = f"{self.tag}-{suffix}"
        _sh("ip", "netns", "add", name)
        self._namespaces.append(name)
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        # Kernel settings every namespace of the lab gets, for experiments (e.g. bench/wan.py with
        # PRIME_WAN_LAB_SYSCTLS="net.ipv4.tcp_slow_start_after_idle=0"): the lab's own defaults are the kernel's
        for setting in os.environ.get(LAB_SYSCTLS_ENV, "").split():
            _sh("ip", "netns", "exec", name, "sysctl", "-qw", setting)
        return name

    @staticmethod
    def _veth(ns_a: str, a: str, ns_b: str, b: str) -> None:
        _sh("ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
        _sh("ip", "netns", "exec", ns_a, "ip", "link", "set", a, "up")
        _sh("ip", "netns", "exec", ns_b, "ip", "link", "set", b, "up")

    @staticmethod
    def _addr(ns: str, dev: str, cidr: str) -> None:
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", cidr, "dev", dev)

    # -- running ---------------------------------------------------------------------------------------
    def spawn(self, site: Site, name: str, argv: list[str], env: dict | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Start `argv` inside `site` (output to <logs>/<name>.log); stopped by close()."""
        return self.spawn_in(site.ns, name, argv, env, cwd)

    def spawn_in(self, ns: str, name: str, argv: list[str], env: dict | None = None,
                 cwd: str | Path | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd=cwd, start_new_session=True)
        log.close()
        self._procs.append(p)
        return p

    def run(self, site: Site, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", site.ns, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def check_delay_lines(self) -> None:
        """Raise LabError if a delay line has died: its queue fails open, so the lab would go on without that
        site's latency and nothing else would notice."""
        dead = [name for name, p in self._delay_lines.items() if p.poll() is not None]
        if dead:
            raise LabError(f"delay lines died: {', '.join(dead)} ({self.log('delay-' + dead[0])[-500:]})")

    def log(self, name: str) -> str:
        p = self.logs / f"{name}.log"
        return p.read_text(errors="replace") if p.is_file() else ""

    # -- tearing down ----------------------------------------------------------------------------------
    def close(self, grace_s: float = 10.0) -> None:
        for p in self._procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait(5)
        for ns in reversed(self._namespaces):
            _delete_netns(ns)
        self._namespaces.clear()


_HOME_ROUTER_RULES = """
table ip home {
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "wan" ct state new drop
    }
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" masquerade
    }
}
"""


def _port_forward_rules(ports: tuple[int, ...], to: str) -> str:
    """A home router's port forward: new connections to these TCP ports on its public side go to `to` (the
    forward chain's policy drops every other new connection from outside)."""
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise ValueError(f"bad ports to forward: {ports!r}")
    plist = ", ".join(str(p) for p in ports)
    return f"""
table ip home {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "wan" tcp dport {{ {plist} }} dnat to {to}
    }}
    chain forward {{
        iifname "wan" oifname "lan" ct status dnat accept
    }}
}}
"""


def _sh(*argv: str, input: str | None = None) -> None:
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")


class LabError(RuntimeError):
    pass


def _tbf(ns: str, dev: str, rate: str) -> None:
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
        "burst", "64kb", "latency", "100ms")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _delete_netns(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_stale_labs() -> None:
    """Delete namespaces of labs whose creating process is gone (a run that was killed)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete_netns(name)


def unavailable() -> str | None:
    """None if a lab can be built here, else one line saying why not."""
    if os.geteuid() != 0:
        return "the WAN lab needs root (network namespaces)"
    for tool in ("ip", "tc", "nft", "iptables"):
        if shutil.which(tool) is None:
            return f"the WAN lab needs `{tool}` (apt-get install iproute2 nftables iptables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _sh("ip", "netns", "add", probe)
    except LabError as e:
        return f"cannot make a network namespace here: {e}"
    try:
        _sh("ip", "netns", "exec", probe, "iptables", "-t", "mangle", "-A", "PREROUTING", "-j", "NFQUEUE",
            "--queue-num", "9", "--queue-bypass")
        _sh("ip", "netns", "exec", probe, "nft", "-f", "-", input=_HOME_ROUTER_RULES.replace('"wan"', '"lo"')
            .replace('"lan"', '"lo"'))
        _sh("ip", "netns", "exec", probe, "ip", "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _tbf(probe, "p0", "20mbit")
    except LabError as e:
        return f"this kernel lacks what the WAN lab needs: {e}"
    finally:
        _delete_netns(probe)
    return None


# -- what the lab tests share: the real CLI, its JSON log lines, polling ---------------------------------------
STATUS = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/v1/status", timeout=5).read().decode())
"""  # run with the coordinator's URL inside a site: its GET /v1/status on stdout


def cli(*args: str) -> list[str]:
    """`prime-node ARGS` from this checkout, with this interpreter."""
    return [sys.executable, "-m", "node.cli", *args]


def json_lines(text: str) -> list[dict]:
    """The JSON records of a log (server.log_format = json), skipping other lines."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_for(what: str, cond, deadline_s: float, check=lambda: None, every_s: float = 0.5):
    """Poll `cond` until it returns something true (returned); `check` between polls raises if the run died."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        got = cond()
        if got:
            return got
        check()
        time.sleep(every_s)
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
