"""Load on demand and the idle clock, as the gateway sees them (seeds 003, "Load a model when someone asks
for it, and stop it when nobody does").

- A request for a model with no Ready replica records demand (Postgres `model_state.demand_at`) and wakes
  the reconciler, which places one replica: its plan counts replicas already starting, so any number of
  concurrent requests, on any number of gateways, cause one load. This gateway writes demand at most once
  per `DEMAND_EVERY_S` per model.
- The request is then held (issue 13, "hold, don't bounce") up to the model's `scaling.load_wait`
  (default 120 s, capped by `LLMGW_LOAD_WAIT_S`) for a Ready replica; a streaming request receives SSE
  comment lines meanwhile (`: loading smollm2-135m, 12 s`) so proxies and clients do not time out. Past
  the wait, or with `scaling.load_queue` requests already held on this gateway, it gets 503, Retry-After
  and "the model is loading": waiting without bound turns a request into a job. Held requests count as
  load, so a burst may start more than one replica (up to `max`). An unknown model is a 404 elsewhere,
  never "loading"; a model the reconciler cannot place is told so at once (`model_unplaceable`).
- Use keeps a model alive: every second, models with requests in flight, and those whose last request
  ended since, are marked used now (`last_used_at`). So the reconciler's idle clock runs from when the
  last request ended, and a model serving a long stream is never idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import uuid
from typing import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo, load_repo
from llmgw.gateway import errors
from llmgw.gateway.load import LoadSampler
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.placement.decisions import refusal
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)
DEMAND_EVERY_S = 2.0
LOADING_RETRY_AFTER_S = 10
WAKE_EVERY_S = 5.0
HOLD_TICK_S = 2.0  # a held request checks for refusal, and a streaming one sends a comment, this often
REFUSED_FOR_S = 10.0  # a held request is told the model cannot be placed once passes refused it this long

Hold = Callable[[float], Awaitable[None]]


class Usage:
    """Per-model requests in flight on this gateway, requests served (a running count), and models whose
    requests ended since the last flush."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self.ended: set[str] = set()

    def begin(self, model: str) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1

    def end(self, model: str) -> None:
        self.in_flight[model] -= 1
        self.served[model] = self.served.get(model, 0) + 1
        self.ended.add(model)

    def take(self) -> set[str]:
        """Models to mark used now: those with requests in flight and those that ended since last time."""
        out = {m for m, n in self.in_flight.items() if n > 0} | self.ended
        self.ended = set()
        return out


class Demand:
    """Asks for loads, holds requests while a model loads, keeps the idle clock honest and reports this
    gateway's load. `load_wait_cap_s` caps every model's `scaling.load_wait`; `flush_s` is the period of the
    use and load reports (seconds)."""

    def __init__(self, engine: AsyncEngine, routes: RouteTable, temporal: LazyClient, load_wait_cap_s: float,
                 flush_s: float = 1.0, queued: Callable[[str], int] = lambda name: 0):
        self.engine = engine
        self.routes = routes
        self.temporal = temporal
        self.load_wait_cap_s = load_wait_cap_s
        self.flush_s = flush_s
        self.usage = Usage()
        self.waiting: dict[str, int] = {}  # model -> requests held here for a Ready replica
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sampler = LoadSampler(self.usage, self.waiting, queued, self._window)
        self._reported_busy = False
        self._asked: dict[str, float] = {}
        self._refusals: dict[str, tuple[float, str | None]] = {}
        self._woke: dict[str, float] = {}
        self._background: set[asyncio.Task] = set()

    def _window(self, name: str) -> float:
        route = self.routes.resolve(name)
        return route.model.effective_scaling.scale_down_delay if route else 60.0

    def ask(self, route: ModelRoute) -> None:
        """Record demand for an on-demand model with no Ready replica and wake the reconciler, in the
        background (a request served by a fallback meanwhile does not wait for it)."""
        model = route.model
        if not model.profiles or not model.effective_scaling.on_demand:
            return
        now = asyncio.get_running_loop().time()
        if now - self._asked.get(model.name, -math.inf) < DEMAND_EVERY_S:
            return
        self._asked[model.name] = now
        task = asyncio.create_task(self._record(model.name))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record(self, name: str) -> None:
        try:
            async with self.engine.begin() as conn:
                await catalog_repo.record_demand(conn, name)
        except Exception:  # noqa: BLE001 - the next request asks again; log and go on to the wake-up
            log.exception("recording demand for %s failed", name)
            self._asked.pop(name, None)
        await self.temporal.wake(f"demand for {name}")

    async def wait(self, route: ModelRoute, holding: Hold | None = None) -> ModelRoute:
        """No Ready replica for `route`: ask for a load if the model may run and hold the request until one
        is Ready (up to the model's `load_wait`), else 503 + Retry-After.

        `holding(waited_s)` is awaited about every `HOLD_TICK_S` while the request waits (a streaming
        request sends SSE comments from it). At most `scaling.load_queue` requests wait per model on this
        gateway; one more is told at once that the model is loading. A model the reconciler keeps refusing
        to place (for REFUSED_FOR_S while held, or at the end of the wait) is reported as such.
        """
        model = route.model
        sc = model.effective_scaling
        if not model.profiles:
            raise errors.unavailable(model.name, "none of its endpoints is reachable")
        if sc.off:
            raise errors.unavailable(model.name, "it is switched off in the catalog (scaling max 0)", retry_after_s=60)
        name = model.name
        if self.waiting.get(name, 0) >= sc.load_queue:
            raise errors.loading(name, retry_after_s=LOADING_RETRY_AFTER_S,
                                 detail=f"{sc.load_queue} requests are already waiting for it on this gateway")
        self.ask(route)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + min(sc.load_wait, self.load_wait_cap_s)
        self.waiting[name] = self.waiting.get(name, 0) + 1
        refused_since: float | None = None
        try:
            while True:
                left = deadline - loop.time()
                ready = await self.routes.wait_for_endpoint(name, max(0.0, min(HOLD_TICK_S, left)))
                if ready and ready.endpoints:
                    return ready
                if loop.time() >= deadline:
                    break
                # A refusal that lasts is the answer; one pass's refusal may be a node still registering.
                why = await self._refused(name)
                refused_since = None if why is None else (refused_since or loop.time())
                if why is not None and loop.time() - refused_since >= REFUSED_FOR_S:
                    raise errors.unplaceable(name, why)
                current = self.routes.resolve(name)
                if current is not None:
                    self.ask(current)  # keeps demand fresh: the model stays wanted while requests wait
                if holding is not None:
                    await holding(loop.time() - started)
        finally:
            self.waiting[name] -= 1
        why = await self._refused(name)
        if why is not None:
            raise errors.unplaceable(name, why)
        raise errors.loading(name, retry_after_s=LOADING_RETRY_AFTER_S,
                             detail=f"no replica was ready after {loop.time() - started:.0f}s")

    async def _refused(self, name: str) -> str | None:
        """Why the reconciler's latest pass could not place `name`, or None when it did not refuse it (then
        the model is genuinely loading, or about to be). A client told "loading" would retry forever.
        Read at most once a second per model, however many requests wait."""
        now = asyncio.get_running_loop().time()
        cached = self._refusals.get(name)
        if cached is not None and now - cached[0] < 1.0:
            return cached[1]
        try:
            async with self.engine.connect() as conn:
                lines, _ = await catalog_repo.get_decisions_at(conn, name)
        except Exception:  # noqa: BLE001 - cannot tell: say loading, the next request asks again
            log.exception("reading the latest decisions for %s failed", name)
            return None
        why = refusal(lines or [], name)
        self._refusals[name] = (now, why)
        return why

    async def flush_loop(self) -> None:
        """Every `flush_s`: mark models used now (requests in flight or just ended), and report this
        gateway's load per model (db/load_repo.py)."""
        while True:
            await asyncio.sleep(self.flush_s)
            names = self.usage.take()
            now = asyncio.get_running_loop().time()
            loads = self.sampler.sample(now)
            self._wake_if_short(loads, now)
            busy = any(not x.idle for x in loads)
            if not names and not busy and not self._reported_busy:
                continue
            try:
                async with self.engine.begin() as conn:
                    for n in sorted(names):
                        await catalog_repo.record_use(conn, n)
                    if busy or self._reported_busy:
                        await load_repo.report(conn, self.gateway_id, loads)
                self._reported_busy = busy
            except Exception:  # noqa: BLE001 - next tick retries; log and count
                log.exception("recording model use and load failed")
                self.usage.ended |= names

    def _wake_if_short(self, loads: list, now: float) -> None:
        """A model whose load here exceeds what its Ready replicas carry wakes the reconciler (at most every
        WAKE_EVERY_S per model), so a scale-up does not wait for the reconciler's timer."""
        for x in loads:
            route = self.routes.resolve(x.model)
            if route is None or not route.model.profiles or x.in_flight + x.queued == 0:
                continue
            if x.in_flight + x.queued <= len(route.endpoints) * route.model.target_in_flight:
                continue
            if now - self._woke.get(x.model, -math.inf) < WAKE_EVERY_S:
                continue
            self._woke[x.model] = now
            task = asyncio.create_task(self.temporal.wake(f"load on {x.model}"))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def forget(self) -> None:
        """On a clean stop: this gateway's load leaves with it rather than after LOAD_FRESH_S."""
        try:
            async with self.engine.begin() as conn:
                await load_repo.forget(conn, self.gateway_id)
        except Exception:  # noqa: BLE001 - it expires anyway
            log.warning("could not remove this gateway's load rows; they expire in %.0fs", load_repo.LOAD_FRESH_S)
