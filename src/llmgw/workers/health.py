"""Liveness of Ready engines on this node (a liveness probe, as Kubernetes has one).

The supervisor notices an engine that exits; nothing noticed one that stopped answering while its process
lived on (frozen by SIGSTOP, a hung driver, a deadlock): it stayed Ready, requests were routed to it and
waited out the gateway's upstream timeout, and `ctl` said nothing. Every `engine_probe_interval_s` each
Ready rank-0 shard is asked for its health as at readiness (`EngineAdapter.is_ready`, 2 s); after
`engine_probe_failures` checks in a row without an answer it is reported failed, with the cause, and
stopped (SIGKILL reaches a stopped process), so that its replica leaves routing and is replaced. An
answer in between starts the count again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from llmgw.engines.registry import Engines
from llmgw.workers.supervisor import Shard, Supervisor

log = logging.getLogger(__name__)
STOP_GRACE_S = 2.0  # a frozen engine does not act on SIGTERM: SIGKILL follows soon


class EngineHealth:
    def __init__(self, supervisor: Supervisor, engines: Engines, interval_s: float, failures: int,
                 report: Callable[[Shard, str], Awaitable[None]]):
        self.supervisor = supervisor
        self.engines = engines
        self.interval_s = interval_s
        self.failures = failures
        self.report = report  # (shard, cause): say it failed, before it is stopped
        self.missed: dict[str, int] = {}

    async def run(self) -> None:
        """Check every Ready engine each interval, until cancelled (with `failures` 0: only wait)."""
        if self.failures <= 0:
            await asyncio.Event().wait()
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(self.interval_s)
                shards = [s for s in self.supervisor.running()
                          if s.state == "ready" and not s.stopping and s.spec.rank == 0 and s.endpoint]
                self.missed = {s.shard_id: self.missed.get(s.shard_id, 0) for s in shards}
                answers = await asyncio.gather(*(self._check(session, s) for s in shards))
                for shard, ok in zip(shards, answers):
                    await self._judge(shard, ok)

    async def _check(self, session: aiohttp.ClientSession, shard: Shard) -> bool:
        try:
            adapter = self.engines.get(shard.spec.profile.engine)
            return await adapter.is_ready(session, shard.endpoint, shard.spec.api_key)
        except Exception:  # noqa: BLE001 - an adapter's bug is not the engine's failure
            log.exception("checking the health of shard %s failed", shard.shard_id)
            return True

    async def _judge(self, shard: Shard, ok: bool) -> None:
        if ok:
            self.missed[shard.shard_id] = 0
            return
        missed = self.missed[shard.shard_id] = self.missed[shard.shard_id] + 1
        if missed < self.failures:
            log.warning("shard %s did not answer its health check (%d of %d in a row)", shard.shard_id, missed,
                        self.failures)
            return
        cause = (f"did not answer {missed} health checks in a row over {missed * self.interval_s:g}s (frozen or "
                 "hung); stopped so that its replica is replaced")
        log.error("shard %s (pid %d) %s", shard.shard_id, shard.pid, cause)
        shard.stopping = True  # its exit is this stop, not news for the exit watch
        try:
            await self.report(shard, cause)
        finally:
            await self.supervisor.stop(shard.shard_id, STOP_GRACE_S)
            self.missed.pop(shard.shard_id, None)
