"""A delay line for kernels without sch_netem: every packet an iptables NFQUEUE rule hands to this process
is held for --delay-ms, then accepted, in order.

Run inside the namespace whose rules queue (the lab's core router):

    iptables -t mangle -A PREROUTING  -i v-h1 -j NFQUEUE --queue-num 1 --queue-bypass   # from site h1
    iptables -t mangle -A POSTROUTING -o v-h1 -j NFQUEUE --queue-num 1 --queue-bypass   # to site h1
    python3 delay_line.py --queue 1 --delay-ms 20

A packet is queued once on the way in (its source site's delay) and once on the way out (its destination
site's), so the round trip between sites A and B is 2 * (delay A + delay B). Raw NETLINK_NETFILTER, no
library: only the packet id is copied to user space (NFQNL_COPY_META) and one batch verdict releases every
packet that is due, about one recv per packet (~60 us of CPU, a third of it the kernel's forwarding of the packet,
counted to this process). The queue fails open (a full queue passes
packets instead of dropping them) and `--queue-bypass` passes packets while no delay line runs, so a dead
delay line shows as missing latency, never as a dead network. SIGTERM releases what is held and exits.

The delay line is the lab's network, not one of its nodes, so it must neither slow down with the box's load
nor take the nodes' CPU:
* It asks for GSO packets whole (NFQA_CFG_F_GSO): without the flag the kernel cuts each TCP super-packet into
  MTU-sized ones and queues each alone, one netlink message (a wake-up, a recv) per 1.5 KB. Nothing here reads
  a payload, so a 64 KB one costs what a 1.5 KB one does.
* It drains every message that is waiting before it sleeps again, and runs as a real-time task (SCHED_FIFO)
  where the kernel allows, so that no load on the box can lengthen a packet's delay. (As an ordinary task it
  held a 40 ms round trip within 1 ms beside 8 busy loops on 2 cores too: the scheduler favours a task that
  sleeps; now it is certain.) It never spins: it sleeps in select() until a packet arrives or the next one is due.
* On exit it prints one line, `delay_line stats {json}`: packets, wake-ups, and how late packets were released
  against their due time (p50 / p99 / max, ms), the lab's own check that its latency is the configured one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import select
import signal
import socket
import struct
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND, CMD_UNBIND = 1, 2
COPY_META = 1
F_FAIL_OPEN, F_GSO = 1, 4
NF_ACCEPT = 1
RT_PRIORITY = 10  # SCHED_FIFO priority: above every ordinary task, below the kernel's own threads (50)


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, 0, 0) + body


def _accept_upto(queue: int, packet_id: int) -> bytes:
    return _message(MSG_VERDICT_BATCH, queue, _attr(ATTR_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def _bind(sock: socket.socket, queue: int, maxlen: int) -> None:
    steps = [
        _attr(CFG_CMD, struct.pack("!BBH", CMD_UNBIND, 0, socket.AF_INET)),  # a stale binding, if any
        _attr(CFG_CMD, struct.pack("!BBH", CMD_BIND, 0, socket.AF_INET)),
        _attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META)) + _attr(CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
        + _attr(CFG_FLAGS, struct.pack("!I", F_FAIL_OPEN | F_GSO))
        + _attr(CFG_MASK, struct.pack("!I", F_FAIL_OPEN | F_GSO)),
    ]
    for i, a in enumerate(steps):
        sock.send(_message(MSG_CONFIG, queue, a, NLM_F_REQUEST | NLM_F_ACK))
        data = sock.recv(65536)
        if struct.unpack_from("=IHHII", data)[1] == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err and i > 0:  # unbinding a queue nobody holds may fail; anything else is fatal
                raise OSError(-err, f"nfqueue config step {i} failed")


def _packet_ids(data: bytes):
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
            a = off + 20  # nlmsghdr (16) + nfgenmsg (4)
            while a + 4 <= off + length:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x3FFF == ATTR_PACKET_HDR:
                    yield struct.unpack_from("!I", data, a + 4)[0]
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3


class Lateness:
    """How late packets leave against their due time: a histogram of 0.1 ms buckets up to 1 s (the rest in the
    last), so a long run costs no memory per packet."""

    BUCKET_S, BUCKETS = 1e-4, 10_001

    def __init__(self) -> None:
        self.counts = [0] * self.BUCKETS
        self.n, self.max_s = 0, 0.0

    def add(self, late_s: float) -> None:
        self.counts[min(self.BUCKETS - 1, max(0, int(late_s / self.BUCKET_S)))] += 1
        self.n += 1
        self.max_s = max(self.max_s, late_s)

    def quantile_ms(self, q: float) -> float:
        want, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= want:
                return round((i + 1) * self.BUCKET_S * 1000, 1)
        return 0.0


def realtime() -> str:
    """Run as SCHED_FIFO if allowed; say which scheduling class the delay line got."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        return "SCHED_FIFO"
    except (OSError, AttributeError) as e:  # no CAP_SYS_NICE, or an RT budget of 0 in this cgroup
        return f"SCHED_OTHER ({e})"


def run(queue: int, delay_s: float, maxlen: int = 8192) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    _bind(sock, queue, maxlen)
    sched = realtime()
    held: collections.deque[tuple[float, int]] = collections.deque()  # (due, packet id), both ascending
    late, wakeups = Lateness(), 0
    print(f"delay_line: queue {queue}, {delay_s * 1000:.1f} ms, {sched}", flush=True)
    try:
        while True:
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
            if select.select([sock], [], [], timeout)[0]:
                wakeups += 1
                due = time.monotonic() + delay_s
                while True:  # everything already waiting, then back to sleep
                    try:
                        data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    except OSError:  # ENOBUFS: the kernel dropped notifications; those packets stay queued
                        break
                    held.extend((due, pid) for pid in _packet_ids(data))
            now, last = time.monotonic(), None
            while held and held[0][0] <= now:
                d, last = held.popleft()
                late.add(now - d)
            if last is not None:  # one message accepts every packet up to `last`
                sock.send(_accept_upto(queue, last))
    except KeyboardInterrupt:
        pass
    finally:
        if held:  # release what we hold rather than strand it
            sock.send(_accept_upto(queue, held[-1][1]))
        sock.close()
        print("delay_line stats " + json.dumps({
            "queue": queue, "sched": sched.split()[0], "packets": late.n, "wakeups": wakeups,
            "late_p50_ms": late.quantile_ms(0.5), "late_p99_ms": late.quantile_ms(0.99),
            "late_max_ms": round(late.max_s * 1000, 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run(a.queue, a.delay_ms / 1000)


if __name__ == "__main__":
    main()
