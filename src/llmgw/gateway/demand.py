"""Load on demand and the idle clock, as the gateway sees them (seeds 003, "Load a model when someone asks
for it, and stop it when nobody does").

- A request for a model with no Ready replica records demand (Postgres `model_state.demand_at`) and wakes
  the reconciler, which places one replica, or wakes a sleeping one (issue 39: the same holding, a faster
  way back): its plan counts replicas already starting, so any number of concurrent requests, on any
  number of gateways, cause one load. This gateway writes demand at most once
  per `DEMAND_EVERY_S` per model.
- The request is then held (issue 13, "hold, don't bounce") up to the model's `scaling.load_wait`
  (default 120 s, capped by `LLMGW_LOAD_WAIT_S`) for a Ready replica; a streaming request receives SSE
  comment lines meanwhile (`: loading smollm2-135m, 12 s`) so proxies and clients do not time out. Held
  requests count as load, so a burst may start more than one replica (up to `max`). Past the wait, or
  with `scaling.load_queue` requests already held on this gateway, it gets 503 with Retry-After and what
  is true (placement/model_status.py): "loading" only while a replica is starting; "failing" with the last
  failure's cause and the backoff left while its starts keep failing (answered at once: a model
  backing off is not loading); "cannot be started" when passes keep refusing to place it; "pending" when nothing
  has started yet; and, when its Ready replicas are all on nodes the control plane cannot reach (heartbeats
  and pollers silent), which nodes those are. Waiting without bound turns a request into a job. An unknown model is a 404 elsewhere.
- A request that was held carries the rung it was held for (`HELD_FOR`: `wake` when its model was sleeping as
  it arrived, else `start`), which the proxy counts with its first token in `llmgw_activation_seconds`.
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
from contextvars import ContextVar
from typing import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo, load_repo, status_repo
from llmgw.http import errors
from llmgw.gateway.load import LoadSampler
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.placement.model_status import ModelCondition, ModelStatus, client_reason
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)
# How the request the current task serves was held: "wake" or "start" (`Demand.wait` sets it as it returns a
# route after holding), None when it was not. Per task: each request is served in its own.
HELD_FOR: ContextVar[str | None] = ContextVar("llmgw_held_for", default=None)
DEMAND_EVERY_S = 2.0
LOADING_RETRY_AFTER_S = 10
CONDITION_TTL_S = 1.0
WAKE_EVERY_S = 5.0
HOLD_TICK_S = 2.0  # a held request checks the model's status, and a streaming one sends a comment, this often
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
        self.draining = asyncio.Event()  # set when the gateway begins to drain: held requests are answered 503
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sampler = LoadSampler(self.usage, self.waiting, queued, self._window)
        self._reported_busy = False
        self._asked: dict[str, float] = {}
        self._conditions: dict[str, tuple[float, ModelCondition]] = {}
        self._reading: dict[str, asyncio.Future] = {}  # model -> the status read in flight (`condition`)
        self._woke: dict[str, float] = {}
        self._background: set[asyncio.Task] = set()

    def _window(self, name: str) -> float:
        route = self.routes.resolve(name)
        return route.model.effective_scaling.scale_down_delay if route else 60.0

    def ask(self, route: ModelRoute) -> None:
        """Record demand for an on-demand model with no Ready replica and wake the reconciler, in the
        background (a request served by a fallback meanwhile does not wait for it)."""
        if self._claim(route.model):
            self._record_soon(route.model.name)

    def _claim(self, model) -> bool:
        """True, once per DEMAND_EVERY_S per on-demand model on this gateway: the caller records demand."""
        if not model.profiles or not model.effective_scaling.on_demand:
            return False
        now = asyncio.get_running_loop().time()
        if now - self._asked.get(model.name, -math.inf) < DEMAND_EVERY_S:
            return False
        self._asked[model.name] = now
        return True

    def _record_soon(self, name: str, renewal: bool = False) -> None:
        task = asyncio.create_task(self._record(name, renewal))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record(self, name: str, renewal: bool = False) -> None:
        try:
            async with self.engine.begin() as conn:
                await catalog_repo.record_demand(conn, name, renewal)
        except Exception:  # noqa: BLE001 - the next request asks again; log and go on to the wake-up
            log.exception("recording demand for %s failed", name)
            self._asked.pop(name, None)
        await self.temporal.wake(f"demand for {name}")

    async def wait(self, route: ModelRoute, holding: Hold | None = None) -> ModelRoute:
        """No Ready replica for `route`: ask for a load if the model may run and hold the request until one
        is Ready (up to the model's `load_wait`), else 503 + Retry-After saying what is true.

        `holding(waited_s)` is awaited about every `HOLD_TICK_S` while the request waits (a streaming
        request sends SSE comments from it). At most `scaling.load_queue` requests wait per model on this
        gateway; one more is answered at once. A model backing off after failed starts is answered at once
        (`model_failing`), as is one the reconciler keeps refusing to place for `REFUSED_FOR_S`
        (`model_unplaceable`) and one whose Ready replicas are all on unreachable nodes.
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
        self.ask(route)  # during a backoff the database does not count it (catalog_repo.record_demand)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + min(sc.load_wait, self.load_wait_cap_s)
        self.waiting[name] = self.waiting.get(name, 0) + 1
        unplaceable_since: float | None = None
        rung: str | None = None
        try:
            while True:
                # The catalog may change while it waits: a model removed is unknown now (404), one switched
                # off will not load; either is said at once rather than after the whole wait.
                current = self.routes.resolve(name)
                if current is None:
                    raise errors.model_not_found(name)
                if current.model.effective_scaling.off:
                    raise errors.unavailable(name, "it was switched off in the catalog (scaling max 0) while this "
                                             "request waited for it", retry_after_s=60)
                cond = await self.condition(name)
                if rung is None:  # as the request found it: asleep, else anything a start answers
                    rung = "wake" if cond is not None and cond.status == ModelStatus.SLEEPING else "start"
                now = loop.time()
                if cond is not None and cond.status == ModelStatus.FAILING and cond.retry_in_s:
                    # Its last start failed and it is backing off: not a load in progress. Held, the client
                    # would wait out the backoff and likely another failure; told at once, it has the cause.
                    raise self._failing(name, cond)
                if cond is not None and cond.status == ModelStatus.READY and self.routes.unreachable.get(name):
                    raise self._unreachable(name)  # Ready, on nodes the control plane cannot see: not a load
                if cond is not None and cond.status == ModelStatus.UNPLACEABLE:
                    unplaceable_since = unplaceable_since or now
                    if now - unplaceable_since >= REFUSED_FOR_S:  # one pass's refusal may be a node registering
                        raise errors.unplaceable(name, cond.reason)
                else:
                    unplaceable_since = None
                ready = await self._wait_endpoint(name, max(0.0, min(HOLD_TICK_S, deadline - loop.time())))
                if self.draining.is_set():  # the gateway is shutting down: the load may take minutes (drain.py)
                    raise errors.draining()
                if ready and ready.endpoints:
                    HELD_FOR.set(rung)
                    return ready
                if loop.time() >= deadline:
                    break
                # A request waiting for the load is demand: kept fresh, or a model whose idle_timeout is shorter
                # than its placement takes (a node registering late) would be let go while it is being waited for.
                # Not once the start it waited for has failed: that demand is spent (placement/scale.py), and
                # renewing it would have the model retried after its backoff for a request that gave up. The
                # database decides (a renewal is conditional), so a failure counted meanwhile is never missed.
                if self._claim((self.routes.resolve(name) or route).model):
                    self._record_soon(name, renewal=True)
                if holding is not None:
                    await holding(loop.time() - started)
        finally:
            self.waiting[name] -= 1
        cond = await self.condition(name, fresh=True)
        if cond is None or cond.status in (ModelStatus.LOADING, ModelStatus.SLEEPING):
            waking = " (waking a sleeping one)" if cond is not None and cond.status == ModelStatus.SLEEPING else ""
            raise errors.loading(name, retry_after_s=LOADING_RETRY_AFTER_S,
                                 detail=f"no replica was ready after {loop.time() - started:.0f}s{waking}")
        if cond.status == ModelStatus.FAILING:
            raise self._failing(name, cond)
        if cond.status == ModelStatus.UNPLACEABLE:
            raise errors.unplaceable(name, cond.reason)
        if cond.status == ModelStatus.READY:
            if self.routes.unreachable.get(name):
                raise self._unreachable(name)
            raise errors.unavailable(name, "its ready replicas are on nodes this gateway does not reach now",
                                     retry_after_s=2)
        raise errors.pending(name)

    async def _wait_endpoint(self, name: str, timeout_s: float) -> ModelRoute | None:
        """`routes.wait_for_endpoint`, ended early when the gateway begins to drain (`draining`)."""
        if self.draining.is_set():
            return None
        waiting = asyncio.ensure_future(self.routes.wait_for_endpoint(name, timeout_s))
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait((waiting, drain), return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if not waiting.done():  # the drain began first
            waiting.cancel()
            return None
        return waiting.result()

    def _unreachable(self, name: str) -> errors.APIError:
        silent = self.routes.unreachable.get(name) or []
        return errors.unavailable(name, f"its Ready replica(s) are on node(s) {', '.join(silent)}, which the control "
                                  "plane cannot reach now (heartbeats and pollers silent)",
                                  retry_after_s=LOADING_RETRY_AFTER_S)

    @staticmethod
    def _failing(name: str, cond: ModelCondition) -> errors.APIError:
        return errors.failing(name, client_reason(cond), cond.retry_in_s or 0, cond.restarts)

    async def condition(self, name: str, fresh: bool = False) -> ModelCondition | None:
        """`name`'s status now (kept `CONDITION_TTL_S`, so a burst of requests for a failing model costs one
        read), or None when it cannot be read (then the answer is "loading", and the next request asks again).
        Requests asking at once share one read (200 requests held together had made 200 reads at each
        tick, queueing the gateway's load reports and route refreshes behind them in the pool)."""
        now = asyncio.get_running_loop().time()
        cached = self._conditions.get(name)
        if cached is not None and not fresh and now - cached[0] < CONDITION_TTL_S:
            return cached[1]
        reading = self._reading.get(name)
        if reading is None:
            reading = self._reading[name] = asyncio.ensure_future(self._read_condition(name, now))
            reading.add_done_callback(lambda _: self._reading.pop(name, None))
        return await asyncio.shield(reading)  # one waiter leaving does not cancel the others' read

    async def _read_condition(self, name: str, now: float) -> ModelCondition | None:
        try:
            async with self.engine.connect() as conn:
                cond = (await status_repo.model_conditions(conn, self.routes.catalog, [name])).get(name)
        except Exception:  # noqa: BLE001 - cannot tell: logged, and the caller says loading
            log.exception("reading the status of %s failed", name)
            return None
        if cond is not None:
            self._conditions[name] = (now, cond)
        return cond

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
