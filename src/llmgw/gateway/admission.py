"""Per-model concurrency limit and queue, enforced by each gateway on its own (catalog `limits:`).

At most `max_concurrency` requests for a model are forwarded at once; up to `max_queue` more wait for a
slot, at most `queue_timeout_s`; beyond that a request is refused at once with 429, and one that waited
too long gets 503, both with Retry-After. Several gateways behind a load balancer each allow
`max_concurrency`: size it per gateway. Who of those waiting gets a freed slot is gateway/fairness.py's
to say: weighted fair queuing by tokens between tenants, inside priority bands (issue 37). A request that
finds a free slot and nobody waiting takes it at once (`try_acquire`): no queue, no await. With
`limits.headroom` (0 by default), an interactive request whose tenant has nothing waiting may take one of
that many slots beyond `max_concurrency` while others wait (gateway/fairness.py).

**The engines' own queues.** A model with a queue (`max_queue` > 0) is also saturated when its engines say
so: each gateway reads how many requests wait in its replicas' engines' own queues (vLLM
`num_requests_waiting`, SGLang's, llama-server's deferred requests, the sim's; gateway/engine_queues.py)
and lowers the model's slots to what the engines are running (`Gate.engines_waiting`), so that the rest
wait here, in fair queues, rather than first come first served inside an engine; while requests wait here
and the engines queue nothing, the slots grow back (by a quarter a reading) up to `max_concurrency` (no
bound when unset). A model without `max_queue` is left to its engines' queues, as before: lowering its
slots would only refuse what an engine would have served.
"""

from __future__ import annotations

import asyncio

from llmgw.gateway.fairness import INTERACTIVE, SHARED_FLOW, FairQueue, Share
from llmgw.http import errors
from llmgw.schemas.catalog import Catalog, Limits


class Gate:
    """One model's slots and queue. `try_acquire()` or `acquire()`, then, always, `release()`."""

    def __init__(self, name: str, limits: Limits):
        self.name = name
        self.limits = limits
        self.ceiling = limits.max_concurrency or 1 << 30  # the most slots it ever has
        self.max_concurrency = self.ceiling  # its slots now: lowered while its engines queue (engines_waiting)
        self.active = 0
        self.waiters = FairQueue()

    @property
    def learns(self) -> bool:
        """Whether its engines' own queues set its slots (it has a queue to hold what they would)."""
        return self.limits.max_queue > 0

    def engines_waiting(self, waiting: int) -> bool:
        """Its engines hold `waiting` requests in their own queues (gateway/engine_queues.py): with any,
        its slots become what they run of its requests (those in flight less those waiting, at least 1);
        with none while its slots are all taken and requests wait here, they grow by a quarter (at least
        one), up to `ceiling`, and those waiting take the new ones. True when its slots changed."""
        slots = self.max_concurrency
        if waiting > 0:
            slots = max(1, min(slots, self.active) - waiting)
        elif self.active >= slots and self.waiters.waiting:
            slots = min(self.ceiling, slots + max(1, slots // 4))
        if slots == self.max_concurrency:
            return False
        self.max_concurrency = slots
        while self.active < slots:  # grown: those waiting take the new slots, as fair queuing orders them
            w = self.waiters.next()
            if w is None:
                break
            self.active += 1
            w.fut.set_result(None)
        return True

    async def acquire(self, share: Share | None = None) -> None:
        """Take a slot, waiting in `share`'s flow (None: the shared flow, cost 1) if there is room in the
        queue. Raises 429/503 `APIError`s."""
        if self.active < self.max_concurrency and not self.waiters.waiting:
            self.active += 1
            return
        if share is None:
            share = Share(SHARED_FLOW)
        queue = self.waiters
        if (self.limits.headroom and self.active < self.max_concurrency + self.limits.headroom
                and share.band == INTERACTIVE and not queue.waits(share)):
            queue.charge(share)  # headroom: a flow with nothing waiting goes on at once (gateway/fairness.py)
            self.active += 1
            return
        if queue.waiting >= self.limits.max_queue:
            out = queue.victim(share) if self.limits.max_queue else None
            if out is None:
                raise errors.overloaded(self.name)
            queue.remove(out)  # a heavier flow's newest waiter makes room (gateway/fairness.py)
            if not out.fut.done():
                out.fut.set_exception(errors.overloaded(self.name))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        waiter = queue.add(fut, share)
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
                queue.remove(waiter)
            if expired:
                raise errors.queue_timeout(self.name, self.limits.queue_timeout_s) from None
            raise
        finally:
            timer.cancel()

    def try_acquire(self) -> bool:
        """Take a free slot now, without queueing: False when there is none or others wait for one."""
        if self.active < self.max_concurrency and not self.waiters.waiting:
            self.active += 1
            return True
        return False

    def release(self) -> None:
        """Give the slot to the waiter fair queuing picks, or free it (a slot of the headroom goes back)."""
        w = self.waiters.next() if self.active <= self.max_concurrency else None
        if w is not None:
            w.fut.set_result(None)
            return
        self.active -= 1

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self.waiters.waiting


class Gates:
    """Model name -> `Gate`, for models with `limits`; kept in step with the catalog."""

    def __init__(self) -> None:
        self.gates: dict[str, Gate] = {}

    def sync(self, catalog: Catalog) -> None:
        """Called after each route refresh: a gate survives while its limits are unchanged."""
        out: dict[str, Gate] = {}
        for m in catalog.models:
            if m.limits is None or (m.limits.max_concurrency is None and not m.limits.max_queue):
                continue
            g = self.gates.get(m.name)
            out[m.name] = g if g is not None and g.limits == m.limits else Gate(m.name, m.limits)
        self.gates = out

    def get(self, name: str) -> Gate | None:
        return self.gates.get(name)
