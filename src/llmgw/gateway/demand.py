"""Load on demand and the idle clock, as the gateway sees them (seeds 003, "Load a model when someone asks
for it, and stop it when nobody does").

- A request for a model with no Ready replica records demand (Postgres `model_state.demand_at`) and wakes
  the reconciler, which places one replica: its plan counts replicas already starting, so any number of
  concurrent requests, on any number of gateways, cause one load. This gateway writes demand at most once
  per `DEMAND_EVERY_S` per model.
- The request then waits up to `load_wait_s` for a Ready replica, and otherwise gets 503 with Retry-After
  and what is true: "loading" only while a replica is starting; "failing" with the last failure's cause and
  the backoff left while its starts keep failing (answered at once: waiting cannot help); "cannot be
  started" when no node can take it; "pending" when nothing has started yet. Refusing outright would make
  on-demand useless, waiting without bound turns a request into a job. An unknown model is a 404 elsewhere.
- Use keeps a model alive: every second, models with requests in flight, and those whose last request
  ended since, are marked used now (`last_used_at`). So the reconciler's idle clock runs from when the
  last request ended, and a model serving a long stream is never idle.
"""

from __future__ import annotations

import asyncio
import logging
import math

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo
from llmgw.gateway import errors
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.gateway.status_service import StatusService
from llmgw.placement.model_status import ModelCondition, ModelStatus
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)
DEMAND_EVERY_S = 2.0
LOADING_RETRY_AFTER_S = 10
CONDITION_TTL_S = 1.0


class Usage:
    """Per-model requests in flight on this gateway, and models whose requests ended since the last flush."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.ended: set[str] = set()

    def begin(self, model: str) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1

    def end(self, model: str) -> None:
        self.in_flight[model] -= 1
        self.ended.add(model)

    def take(self) -> set[str]:
        """Models to mark used now: those with requests in flight and those that ended since last time."""
        out = {m for m, n in self.in_flight.items() if n > 0} | self.ended
        self.ended = set()
        return out


class Demand:
    """Asks for loads and keeps the idle clock honest. `flush_s` is the use-flush period (seconds)."""

    def __init__(self, engine: AsyncEngine, routes: RouteTable, temporal: LazyClient, load_wait_s: float,
                 flush_s: float = 1.0):
        self.engine = engine
        self.routes = routes
        self.temporal = temporal
        self.load_wait_s = load_wait_s
        self.flush_s = flush_s
        self.usage = Usage()
        self.status = StatusService(engine)
        self._asked: dict[str, float] = {}
        self._conditions: dict[str, tuple[float, ModelCondition]] = {}
        self._background: set[asyncio.Task] = set()

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

    async def wait(self, route: ModelRoute) -> ModelRoute:
        """No Ready replica for `route`: ask for a load if the model may run, wait, else 503 + Retry-After
        saying what is true (placement/model_status.py): failing (backing off after failed starts, with the
        cause, Retry-After the backoff left), loading (only while a replica is starting), unplaceable, or
        pending (nothing started yet)."""
        model = route.model
        sc = model.effective_scaling
        if not model.profiles:
            raise errors.unavailable(model.name, "none of its endpoints is reachable")
        if sc.off:
            raise errors.unavailable(model.name, "it is switched off in the catalog (scaling max 0)", retry_after_s=60)
        self.ask(route)
        cond = await self.condition(model.name)
        if cond is not None and cond.status == ModelStatus.FAILING and cond.retry_in_s:
            raise self._failing(model.name, cond)  # backing off: waiting here would change nothing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_wait_s
        while True:
            ready = await self.routes.wait_for_endpoint(model.name, min(DEMAND_EVERY_S, max(0.0, deadline - loop.time())))
            if ready and ready.endpoints:
                return ready
            if loop.time() >= deadline:
                break
            # A request waiting for the load is demand: kept fresh, or a model whose idle_timeout is shorter
            # than its placement takes (a node registering late) would be let go while it is being waited for.
            self.ask(route)
        cond = await self.condition(model.name, fresh=True)
        if cond is None or cond.status == ModelStatus.LOADING:
            raise errors.loading(model.name, retry_after_s=LOADING_RETRY_AFTER_S)
        if cond.status == ModelStatus.FAILING:
            raise self._failing(model.name, cond)
        if cond.status == ModelStatus.UNPLACEABLE:
            raise errors.unplaceable(model.name, cond.reason)
        if cond.status == ModelStatus.READY:
            raise errors.unavailable(model.name, "its ready replicas are on nodes this gateway does not reach now",
                                     retry_after_s=2)
        raise errors.pending(model.name)

    @staticmethod
    def _failing(name: str, cond: ModelCondition) -> errors.APIError:
        return errors.failing(name, cond.reason, cond.retry_in_s or 0, cond.restarts)

    async def condition(self, name: str, fresh: bool = False) -> ModelCondition | None:
        """`name`'s status now (kept `CONDITION_TTL_S`, so a burst of requests for a failing model costs one
        read), or None when it cannot be read (then the answer is "loading", and the next request asks again)."""
        now = asyncio.get_running_loop().time()
        cached = self._conditions.get(name)
        if cached is not None and not fresh and now - cached[0] < CONDITION_TTL_S:
            return cached[1]
        try:
            cond = (await self.status.conditions(self.routes.catalog, [name])).get(name)
        except Exception:  # noqa: BLE001 - cannot tell: logged, and the caller says loading
            log.exception("reading the status of %s failed", name)
            return None
        if cond is not None:
            self._conditions[name] = (now, cond)
        return cond

    async def flush_loop(self) -> None:
        """Every `flush_s`, mark models used now (requests in flight or just ended)."""
        while True:
            await asyncio.sleep(self.flush_s)
            names = self.usage.take()
            if not names:
                continue
            try:
                async with self.engine.begin() as conn:
                    for n in sorted(names):
                        await catalog_repo.record_use(conn, n)
            except Exception:  # noqa: BLE001 - next tick retries; log and count
                log.exception("recording model use failed")
                self.usage.ended |= names
