"""The one rate limiter of every role: a clock-free token bucket, with a keyed form and asyncio and
trio adapters. Used for upload caps shared by every transfer of a server (the coordinator's and a
relay's HTTP uploads, a peer's shard streams), per-node request limits, joins per address, and the
per-forwarding-peer gossip limit checked before any signature.

Two ways to take tokens. `reserve` may go into debt: a sender takes what it needs and then sleeps until
the bucket is back at zero, so concurrent senders share the rate and a chunk larger than the burst
still passes (just later). `try_take` takes only if there is enough, else refuses; nothing owed.
The arithmetic is separate from the clock so it can be tested without sleeping.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None, *, now: float = 0.0):
        if rate <= 0:
            raise ValueError("rate must be > 0 bytes/s")
        self.rate = float(rate)
        # Default burst: 50 ms of traffic, so a fresh bucket does not let a whole shard through.
        self.burst = float(burst) if burst is not None else max(self.rate * 0.05, 1.0)
        self._tokens = self.burst
        self._last = now

    def reserve(self, n: int, now: float) -> float:
        """Take `n` tokens at time `now`; return how long to wait before sending them."""
        elapsed = max(0.0, now - self._last)
        self._last = max(self._last, now)
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def peek(self, now: float) -> float:
        """The tokens the bucket would hold at `now` (nothing changes)."""
        return min(self.burst, self._tokens + max(0.0, now - self._last) * self.rate)

    def try_take(self, n: float, now: float) -> bool:
        """Take `n` tokens at time `now` if the bucket holds them; never goes into debt."""
        elapsed = max(0.0, now - self._last)
        self._last = max(self._last, now)
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
        if self._tokens < n:
            return False
        self._tokens -= n
        return True


class KeyedRateLimit:
    """A token bucket per key (a forwarding peer), taken from with `try_take` (never in debt):
    `allow(key)` is O(1), and at most `max_keys` buckets are kept (the least recently used is
    forgotten: it comes back full, which only favours a peer that was quiet while `max_keys`
    others spoke)."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        TokenBucket(rate, burst)  # validate now
        self.rate, self.burst = float(rate), float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def allow(self, key: Hashable) -> bool:
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now=now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.try_take(1, now)

    def would_allow(self, key: Hashable) -> bool:
        """Whether `allow(key)` would pass now, taking nothing and creating no bucket: a check made before
        a request is authenticated must not let anyone spend another key's tokens."""
        bucket = self._buckets.get(key)
        return bucket is None or bucket.peek(self.clock()) >= 1


class SharedBucket:
    """One TokenBucket on the monotonic clock, taken from by several threads: a node's libp2p (trio) thread
    and its asyncio loop serve shards under one upload cap."""

    def __init__(self, rate: float, burst: float | None = None):
        self._bucket = TokenBucket(rate, burst, now=time.monotonic())
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        with self._lock:
            return self._bucket.reserve(n, time.monotonic())


class AsyncRateLimiter:
    """TokenBucket on the asyncio loop's clock: `await acquire(n)` returns once `n` tokens are paid for.
    A rate of 0 means unlimited. Concurrent callers share the rate (one event loop: no lock needed);
    `shared` takes the tokens from a SharedBucket instead (rate and burst are then its)."""

    def __init__(self, rate: float, burst: float | None = None, *, shared: SharedBucket | None = None):
        self._bucket = TokenBucket(rate, burst, now=time.monotonic()) if rate > 0 and shared is None else None
        self._shared = shared

    async def acquire(self, n: int) -> None:
        if self._shared is not None:
            delay = self._shared.reserve(n)
        elif self._bucket is not None:
            delay = self._bucket.reserve(n, time.monotonic())
        else:
            return
        if delay > 0:
            await asyncio.sleep(delay)


class TrioRateLimiter:
    """TokenBucket on trio's clock, or a SharedBucket's (`shared`). Only used from the trio thread."""

    def __init__(self, rate: float, burst: float | None = None, *, shared: SharedBucket | None = None):
        import trio

        self._trio = trio
        self._bucket = TokenBucket(rate, burst)  # validates now; its clock starts at the first use
        self._started = False
        self._shared = shared

    async def acquire(self, n: int) -> None:
        if self._shared is not None:
            delay = self._shared.reserve(n)
        else:
            now = self._trio.current_time()
            if not self._started:
                self._bucket._last, self._started = now, True
            delay = self._bucket.reserve(n, now)
        if delay > 0:
            await self._trio.sleep(delay)


DEFAULT_MIN_SEND_RATE = 16 * 1024  # bytes/s: an honest 20 Mbit/s home uplink is ~150x this
DEFAULT_SEND_GRACE_S = 10.0


class MinSendRate:
    """A floor on how fast a client takes what a server sends it, as the time it may keep the server waiting.

    The client starts with `grace_s` seconds of credit. Time spent waiting for it to take bytes (a write
    that blocks, a transport paused above its high-water mark) uses credit; every byte it takes earns
    1/`min_rate` seconds, and credit never exceeds `grace_s`. Credit spent = cut. So a reader averaging at
    least `min_rate` over any stretch is never cut (an honest 20 Mbit/s uplink is 150x a 16 KiB/s floor),
    one that stops reading is cut about `grace_s` after its buffers filled, and a trickle just above a
    per-write timeout cannot hold a slot for an hour. Pure arithmetic: the caller owns the clock."""

    def __init__(self, min_rate: float, grace_s: float):
        if min_rate <= 0 or grace_s <= 0:
            raise ValueError("min_rate and grace_s must be > 0")
        self.min_rate, self.grace_s = float(min_rate), float(grace_s)
        self.credit = self.grace_s

    def allowance(self, n: int = 0) -> float:
        """Seconds the client may take to accept `n` more bytes (0: what it may keep us waiting now)."""
        return self.credit + n / self.min_rate

    def spent(self, n: int, elapsed: float) -> None:
        """The client took `n` bytes in `elapsed` seconds of waiting."""
        self.credit = min(self.grace_s, self.credit + n / self.min_rate - max(0.0, elapsed))
