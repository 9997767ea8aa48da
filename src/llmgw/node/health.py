"""Liveness of Ready engines on this node (a liveness probe, as Kubernetes has one).

The supervisor notices an engine that exits; nothing noticed one that stopped answering while its process
lived on (frozen by SIGSTOP, a hung driver, a deadlock): it stayed Ready, requests were routed to it and
waited out the gateway's upstream timeout, and `ctl` said nothing. Every `engine_probe_interval_s` each
Ready rank-0 shard is asked for its health as at readiness (`EngineAdapter.is_ready`, 2 s); after
`engine_probe_failures` checks in a row without an answer it is reported failed, with the cause, and
stopped (SIGKILL reaches a stopped process), so that its replica leaves routing and is replaced. An
answer in between starts the count again.

The same pass holds each engine to the host memory its profile declares (`memory_gb`, what placement
counted against the node): an engine whose process tree uses more than `MEMORY_MARGIN` times that
(starting or Ready: `--ctx-size 999999999` grew llama-server to 10 GB while it loaded, on a profile that
declared 1) is reported failed with what it used, and stopped, before it takes the node's memory from the
engines beside it. A profile without `memory_gb` is not held to one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import psutil

from llmgw.engines.registry import Engines
from llmgw.node.supervisor import Shard, Supervisor
from llmgw.schemas.status import ShardStatus

log = logging.getLogger(__name__)
STOP_GRACE_S = 2.0  # a frozen engine does not act on SIGTERM: SIGKILL follows soon
MEMORY_MARGIN = 1.5  # over its declared memory_gb by half as much again: not an estimate's error


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and its descendants (an engine's workers), 0 when it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class EngineHealth:
    def __init__(self, supervisor: Supervisor, engines: Engines, interval_s: float, failures: int,
                 report: Callable[[Shard, str], Awaitable[None]]):
        self.supervisor = supervisor
        self.engines = engines
        self.interval_s = interval_s
        self.failures = failures
        self.report = report  # (shard, cause): say it failed (in the background, while it is stopped)
        self.missed: dict[str, int] = {}
        self._reports: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Check every Ready engine each interval, until cancelled (with `failures` 0: only wait)."""
        if self.failures <= 0:
            await asyncio.Event().wait()
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self._pass(session)
                except Exception:  # noqa: BLE001 - this task ending would end the agent (and its engines)
                    log.exception("an engine health pass failed; the next one runs in %gs", self.interval_s)

    async def _pass(self, session: aiohttp.ClientSession) -> None:
        for shard in self.supervisor.running():
            if not shard.stopping:
                await self._hold_to_memory(shard)
        shards = [s for s in self.supervisor.running()
                  if s.state == ShardStatus.READY and not s.stopping and s.spec.rank == 0 and s.endpoint]
        self.missed = {s.shard_id: self.missed.get(s.shard_id, 0) for s in shards}
        answers = await asyncio.gather(*(self._check(session, s) for s in shards))
        for shard, ok in zip(shards, answers):
            await self._judge(shard, ok)

    async def _hold_to_memory(self, shard: Shard) -> None:
        declared = shard.spec.profile.memory_gb
        if not declared or shard.in_process:  # an in-process sim replica's memory is its simulator's: not its own
            return
        used = tree_rss(shard.pid)
        # Asleep, it also holds its weights offloaded from the GPUs (issue 39): what placement counts for it.
        offloaded = shard.spec.profile.sleep_host_mb() * (1 << 20) if shard.asleep else 0
        if used <= declared * MEMORY_MARGIN * (1 << 30) + offloaded:
            return
        await self._fail(shard, f"used {used / (1 << 30):.2f} GiB of host memory, over {MEMORY_MARGIN:g} x its "
                                f"profile's memory_gb ({declared:g}); stopped before it takes the node's memory. "
                                "Declare what it needs (memory_gb), or make it need less (a smaller --ctx-size)")

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
        await self._fail(shard, f"did not answer {missed} health checks in a row over {missed * self.interval_s:g}s "
                                "(frozen or hung); stopped so that its replica is replaced")

    async def _fail(self, shard: Shard, cause: str) -> None:
        """Report the failure and stop the engine. The report goes in the background: a safety action of
        this node never waits on the control plane (a report retried for a minute against an unreachable
        one had kept a runaway engine growing, and every other engine's check waiting, that long)."""
        log.error("shard %s (pid %d) %s", shard.shard_id, shard.pid, cause)
        shard.stopping = True  # its exit is this stop, not news for the exit watch
        task = asyncio.create_task(self.report(shard, cause))
        self._reports.add(task)
        task.add_done_callback(self._reported)
        try:
            await self.supervisor.stop(shard.shard_id, STOP_GRACE_S)
        finally:
            self.missed.pop(shard.shard_id, None)

    def _reported(self, task: asyncio.Task) -> None:
        self._reports.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("reporting a failed health check: %s", task.exception())
