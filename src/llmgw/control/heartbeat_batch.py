"""Heartbeats that arrive within a few milliseconds share one transaction (issue 42).

Each steady-state heartbeat (no inventory, no downloads: `fleet_service.batchable`) joins the batch being
gathered; the batch is written `window_s` after its first beat arrived, or at once when it holds
`max_batch`, by `FleetService.heartbeat_many` (one statement stamps every node and reads their shards).
At most `max_flushes` batches are written at a time; beats keep gathering meanwhile.

One heartbeat never fails the others: when a batch's transaction fails for any reason but the database
being away (a deadlock with another writer, a transition that raises), nothing of it was applied, and
each of its heartbeats is served alone by `FleetService.heartbeat`, its own transaction, its own answer or
error. With the database away every beat of the batch gets that error (503 `database_unavailable`, as
each would alone), without a connection attempt each.

A beat whose client went away before its batch was written is still applied (as one already sent to
Postgres would be); nothing waits for it.
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.http.errors import database_away
from llmgw.schemas.api import HeartbeatRequest, HeartbeatResponse

log = logging.getLogger(__name__)

WINDOW_S = 0.003  # a beat waits at most this long for others: against a 5 s interval, nothing
MAX_BATCH = 256
MAX_FLUSHES = 4  # batches written at once (the node API's pool holds 32 connections)


class HeartbeatBatcher:
    """Gathers heartbeats into batches for `fleet` (a `FleetService`); `beat()` answers each one."""

    def __init__(self, fleet, window_s: float = WINDOW_S, max_batch: int = MAX_BATCH,
                 max_flushes: int = MAX_FLUSHES):
        self.fleet = fleet
        self.window_s = window_s
        self.max_batch = max_batch
        self._flushes = asyncio.Semaphore(max_flushes)
        self._pending: list[tuple[HeartbeatRequest, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0  # written, and the beats in them (for tests and the bench)
        self.beats = 0

    async def beat(self, req: HeartbeatRequest) -> HeartbeatResponse:
        """`req`'s answer once its batch is committed; raises what serving it alone would raise."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((req, fut))
        if len(self._pending) >= self.max_batch:
            self._cut()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._cut)
        return await fut

    def _cut(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._write(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write(self, batch: list[tuple[HeartbeatRequest, asyncio.Future]]) -> None:
        reqs = [req for req, _ in batch]
        async with self._flushes:
            try:
                results: list = await self.fleet.heartbeat_many(reqs)
                self.batches += 1
                self.beats += len(reqs)
            except Exception as exc:  # noqa: BLE001 - answered below, beat by beat
                if database_away(exc) is not None:
                    log.warning("a batch of %d heartbeats failed: the database is unavailable: %s", len(reqs),
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    results = [exc] * len(reqs)
                else:
                    log.warning("a batch of %d heartbeats failed (%s: %s); serving each alone", len(reqs),
                                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    results = await asyncio.gather(*(self.fleet.heartbeat(r) for r in reqs), return_exceptions=True)
            except BaseException as exc:  # cancelled (the node API stopping): nobody is left without an answer
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("node API stopping"))
                raise
        for (_, fut), result in zip(batch, results):
            if fut.done():  # its request was cancelled (the client went away)
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
