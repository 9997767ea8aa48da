"""The gateway's route table: which Ready replicas serve each model, read from Postgres.

Refreshed on every `llmgw_routes` notification (a trigger fires on replica and catalog changes) and on a
short timer, since a node going silent changes nothing in the tables. Replicas on a node whose heartbeat
is older than `unreachable_after_s` get no new requests. Never read from Temporal.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo, fleet_repo
from llmgw.db.engine import libpq_url
from llmgw.schemas.catalog import Catalog, Model

log = logging.getLogger(__name__)
CHANNEL = "llmgw_routes"


@dataclass
class Endpoint:
    """One Ready replica as the gateway sees it; `outstanding` is this gateway's requests in flight."""

    replica_id: str
    url: str
    node_id: str
    outstanding: int = 0


@dataclass
class ModelRoute:
    model: Model
    endpoints: list[Endpoint] = field(default_factory=list)


class RouteTable:
    def __init__(self, engine: AsyncEngine, database_url: str, unreachable_after_s: float, refresh_s: float):
        self.engine = engine
        self.database_url = database_url
        self.unreachable_after_s = unreachable_after_s
        self.refresh_s = refresh_s
        self.catalog = Catalog()
        self.models: dict[str, ModelRoute] = {}
        self.names: dict[str, str] = {}  # name or alias -> canonical name
        self._endpoints: dict[str, Endpoint] = {}
        self.changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._dirty = asyncio.Event()

    def resolve(self, name: str) -> ModelRoute | None:
        canonical = self.names.get(name)
        return self.models.get(canonical) if canonical else None

    async def refresh(self) -> None:
        async with self.engine.connect() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            rows = await fleet_repo.routable_replicas(conn)
        models: dict[str, ModelRoute] = {m.name: ModelRoute(m) for m in catalog.models}
        names: dict[str, str] = {}
        for m in catalog.models:
            names[m.name] = m.name
            for a in m.aliases:
                names.setdefault(a, m.name)
        seen: dict[str, Endpoint] = {}
        for m in catalog.models:
            for i, url in enumerate(m.endpoints):  # static endpoints: engines run elsewhere
                key = f"static:{m.name}:{i}"
                ep = self._endpoints.get(key) or Endpoint(key, url.rstrip("/"), "static")
                ep.url = url.rstrip("/")
                seen[key] = ep
                models[m.name].endpoints.append(ep)
        for r in rows:
            if r.model not in models or r.node_age_s >= self.unreachable_after_s:
                continue
            ep = self._endpoints.get(r.replica_id) or Endpoint(r.replica_id, r.endpoint.rstrip("/"), r.node_id)
            seen[r.replica_id] = ep
            models[r.model].endpoints.append(ep)
        self.catalog, self.models, self.names, self._endpoints = catalog, models, names, seen
        async with self.changed:
            self.changed.notify_all()

    async def wait_for_endpoint(self, name: str, timeout_s: float) -> ModelRoute | None:
        """Wait up to `timeout_s` for `name` to have a Ready replica (load on demand)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.changed:
            while True:
                route = self.resolve(name)
                if route and route.endpoints:
                    return route
                left = deadline - loop.time()
                if left <= 0:
                    return route
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    return self.resolve(name)

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.create_task(self._listen(), name="routes-listen"),
                       asyncio.create_task(self._tick(), name="routes-tick"),
                       asyncio.create_task(self._refresher(), name="routes-refresh")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _refresher(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep serving the last table; count and log
                log.exception("route refresh failed")
                await asyncio.sleep(1)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            self._dirty.set()

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(libpq_url(self.database_url), autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._dirty.set()  # anything missed while not listening
                    async for _ in conn.notifies():
                        self._dirty.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect; the timer keeps the table fresh meanwhile
                log.warning("LISTEN %s lost (%s); reconnecting", CHANNEL, exc)
                await asyncio.sleep(2)
