"""Ordered, bounded parallelism over shards: results come back in order, at most `window` in flight."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], *, threads: int,
                window: int | None = None) -> Iterator[tuple[T, "Future[R]"]]:
    """Yield (item, finished future) in input order. Memory stays bounded by `window` results (default
    threads + 1) because new work is only submitted as old results are consumed. Abandoning the
    iterator cancels whatever has not started."""
    window = max(1, window or threads + 1)
    pending: deque[tuple[T, Future]] = deque()
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpt")
    try:
        it = iter(items)
        for item in it:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= window:
                break
        while pending:
            item, fut = pending.popleft()
            fut.exception()  # wait without raising; the caller decides what an error means
            for nxt in it:
                pending.append((nxt, pool.submit(fn, nxt)))
                break
            yield item, fut
    finally:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
