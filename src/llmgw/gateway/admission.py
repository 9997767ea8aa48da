"""Per-model concurrency limit and queue, enforced by each gateway on its own (catalog `limits:`).

At most `max_concurrency` requests for a model are forwarded at once; up to `max_queue` more wait in
arrival order for a slot, at most `queue_timeout_s`; beyond that a request is refused at once with 429,
and one that waited too long gets 503, both with Retry-After. Several gateways behind a load balancer each
allow `max_concurrency`: size it per gateway.
"""

from __future__ import annotations

import asyncio
from collections import deque

from llmgw.http import errors
from llmgw.schemas.catalog import Catalog, Limits


class Gate:
    """One model's slots and queue. `acquire()` then, always, `release()`."""

    def __init__(self, name: str, limits: Limits):
        self.name = name
        self.limits = limits
        self.max_concurrency = limits.max_concurrency or 1 << 30
        self.active = 0
        self.waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if there is room. Raises 429/503 `APIError`s."""
        if self.active < self.max_concurrency and not self.waiters:
            self.active += 1
            return
        if len(self.waiters) >= self.limits.max_queue:
            raise errors.overloaded(self.name)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters.append(fut)
        expired = False

        def expire() -> None:
            nonlocal expired
            if not fut.done():
                expired = True
                fut.cancel()

        timer = loop.call_later(self.limits.queue_timeout_s, expire)
        try:
            await fut  # release() hands its slot over by setting the result
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived just as we were cancelled: pass it on
            else:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            if expired:
                raise errors.queue_timeout(self.name, self.limits.queue_timeout_s) from None
            raise
        finally:
            timer.cancel()

    def try_acquire(self) -> bool:
        """Take a free slot now, without queueing: False when there is none."""
        if self.active < self.max_concurrency and not self.waiters:
            self.active += 1
            return True
        return False

    def release(self) -> None:
        """Give the slot to the longest waiter, or free it."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


class Gates:
    """Model name -> `Gate`, for models with `limits`; kept in step with the catalog."""

    def __init__(self) -> None:
        self.gates: dict[str, Gate] = {}

    def sync(self, catalog: Catalog) -> None:
        """Called after each route refresh: a gate survives while its limits are unchanged."""
        out: dict[str, Gate] = {}
        for m in catalog.models:
            if m.limits is None or (m.limits.max_concurrency is None):
                continue
            g = self.gates.get(m.name)
            out[m.name] = g if g is not None and g.limits == m.limits else Gate(m.name, m.limits)
        self.gates = out

    def get(self, name: str) -> Gate | None:
        return self.gates.get(name)
