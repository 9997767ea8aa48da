"""Change notifications from Postgres: LISTEN on `llmgw_routes` and refresh whoever depends on a table.

Triggers (migrations 0001, 0002) notify with the changed table's name as payload. Each subscriber names
the tables it reads and gets its `refresh()` called after a change there, after every (re)connection of
the listener (changes may have been missed meanwhile), and every `refresh_s` seconds, because some
changes are not table writes (a node going silent only ages its heartbeat). An unknown payload refreshes
everyone. Refreshes of one subscriber never overlap, and a burst of notifications costs one refresh. A
subscriber may ask to be told which of its tables changed (`partial`): the route table then skips reading
the catalog when only replicas changed (issue 13: a replica turning Ready is on the cold-start path).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import psycopg

from llmgw.db.engine import libpq_url

log = logging.getLogger(__name__)
CHANNEL = "llmgw_routes"


class _Subscriber:
    def __init__(self, name: str, tables: frozenset[str], refresh: Callable[..., Awaitable[None]], partial: bool):
        self.name = name
        self.tables = tables
        self.refresh = refresh
        self.partial = partial  # `refresh` takes the tables that changed since its last call (None: any)
        self.changed: set[str] | None = set()
        self.dirty = asyncio.Event()

    async def run_refresh(self) -> None:
        tables, self.changed = self.changed, set()
        try:
            await (self.refresh(tables) if self.partial else self.refresh())
        except BaseException:
            self.changed = None  # whatever this refresh missed, the next one reads in full
            raise


class ChangeFeed:
    """One LISTEN connection per process, fanned out to subscribers."""

    def __init__(self, database_url: str, refresh_s: float):
        self.database_url = database_url
        self.refresh_s = refresh_s
        self.subscribers: list[_Subscriber] = []
        self._tasks: list[asyncio.Task] = []

    def subscribe(self, name: str, tables: set[str], refresh: Callable[..., Awaitable[None]],
                  partial: bool = False) -> None:
        """Call `refresh()` when one of `tables` changes (and on reconnect and on the timer). With `partial`,
        `refresh(changed)` is told which of its tables changed since its last call: a set of names, or
        None when that is not known (the first refresh, a reconnect, the timer, an unknown payload, a
        refresh that failed), when it must read everything."""
        self.subscribers.append(_Subscriber(name, frozenset(tables), refresh, partial))

    def changed(self, table: str | None = None) -> None:
        """Mark subscribers of `table` (all when None or unknown) for a refresh."""
        mine = [s for s in self.subscribers if table in s.tables]
        for s in mine or self.subscribers:
            if mine and s.changed is not None:
                s.changed.add(table)  # type: ignore[arg-type]
            else:
                s.changed = None
            s.dirty.set()

    async def start(self) -> None:
        """First refresh of every subscriber (errors propagate: a gateway that cannot read its tables
        should not start), then the listener, the timer and one refresher per subscriber."""
        for s in self.subscribers:
            s.changed = None
            await s.run_refresh()
        self._tasks = [asyncio.create_task(self._listen(), name="feed-listen"),
                       asyncio.create_task(self._tick(), name="feed-tick")]
        self._tasks += [asyncio.create_task(self._refresher(s), name=f"feed-{s.name}") for s in self.subscribers]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _refresher(self, s: _Subscriber) -> None:
        while True:
            await s.dirty.wait()
            s.dirty.clear()
            try:
                await s.run_refresh()
            except Exception:  # noqa: BLE001 - keep serving what we have; the next change or tick retries
                log.exception("refreshing %s failed", s.name)
                await asyncio.sleep(1)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            self.changed()

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(libpq_url(self.database_url), autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.changed()  # anything missed while not listening
                    async for note in conn.notifies():
                        self.changed(note.payload or None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect; the timer keeps everyone fresh meanwhile
                log.warning("LISTEN %s lost (%s); reconnecting", CHANNEL, exc)
                await asyncio.sleep(2)
