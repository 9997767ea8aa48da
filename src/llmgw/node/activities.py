"""Node activities, run by the node worker on its own queue `node/<node_id>`.

Each is idempotent on the shard id the workflow gives it: a retried `launch_shard` finds the shard it
already started (or adopted after a worker restart) instead of starting a second engine.

Fencing (node/fences.py): `stop_shard` records the replica's fence on disk before it stops anything;
`fetch_weights`, `open_rendezvous`, `launch_shard` and `start_shard` (every command that fetches, opens or
starts something) refuse a replica fenced at a later generation than theirs, so a replica this node was told to
stop never launches here. Waiting, draining and stopping start nothing and carry no generation.

Each serving shard gets a fresh engine key here, on its node (engines/base.py): it goes to the engine, to
the shard's spec file and, over the node API, to the control plane; never into a workflow's history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmgw.failures import expected_failure
from llmgw.catalog.policy import PolicyError, check_profile
from llmgw.engines.base import EngineError, Ports, ShardSpec, SleepError, new_api_key
from llmgw.schemas.api import LaunchCheckResponse
from llmgw.schemas.inventory import AdapterFile, DownloadProgress
from llmgw.schemas.status import ShardStatus
from llmgw.schemas.payloads import (
    NOT_WANTED, STILL_SERVING, UNREACHABLE, DrainShardInput, SleepShardInput, SleepShardResult, WakeShardInput,
    WakeShardResult, DrainShardResult, FetchWeightsInput, FetchWeightsResult, LaunchShardInput,
    LaunchShardResult, NodeReclaimInput, NodeReclaimResult, OpenRendezvousInput, ReadShardLogInput, ReadShardLogResult,
    Rendezvous, StartShardInput, StopShardInput, StopShardResult, WaitShardJoinedInput, WaitShardJoinedResult,
    WaitShardReadyInput, WaitShardReadyResult,
)
from llmgw.weights.fetcher import FetchError, Peer
from llmgw.node.errors import ReportRefused
from llmgw.node.compile_dirs import CompileDir, compile_dir_for
from llmgw.node.logs import BadShardId, read_log
from llmgw.node.readiness import ReadinessCues
from llmgw.node.reclaim import reclaim
from llmgw.node.supervisor import ENGINE_KEY_SHOWN
from llmgw.workflows.ids import replica_of

if TYPE_CHECKING:
    from llmgw.node.host import NodeHost
    from llmgw.node.supervisor import Shard

log = logging.getLogger(__name__)
FETCHED_IN_USE_S = 600.0  # weights a start fetched are not reclaimed for this long, launched or not
RECHECK_AFTER_S = 0.25  # a fetch longer than this (or one that downloaded) is followed by "still wanted?" again
ADAPTER_FETCH_RETRIES_S = (1.0, 3.0)  # waits before fetching an adapter again after a passing failure
SLEEP_GRACE_S = 1.0  # before a sleep looks at what is in flight: the gateways' route tables follow the NOTIFY


class NodeActivities:
    """Bound to the node worker through `NodeHost` (node/host.py): its parts and what it may be asked."""

    def __init__(self, agent: "NodeHost"):
        self.agent = agent
        self._watches: dict[str, asyncio.Task] = {}  # shard id -> the task watching it become ready
        self._fetched: dict[str, float] = {}  # weights path -> when a start last fetched (or found) it
        self._ports = Ports()  # engine ports handed out: never one a live shard has, or given lately

    def all(self) -> list:
        return [self.fetch_weights, self.open_rendezvous, self.launch_shard, self.start_shard, self.wait_shard_joined,
                self.wait_shard_ready, self.drain_shard, self.stop_shard, self.reclaim_cache, self.read_shard_log,
                self.sleep_shard, self.wake_shard]

    def _check_fence(self, replica_id: str, generation: int, what: str) -> None:
        fence = self.agent.fences.refuses(replica_id, generation)
        if fence is not None:
            log.warning("refused to %s for replica %s (generation %d): told to stop it at generation %d",
                        what, replica_id, generation, fence)
            raise ApplicationError(
                f"node {self.agent.node_id} refuses to {what} for replica {replica_id}: it was told to stop it "
                f"(fence generation {fence}, this command's {generation})", type="Fenced", non_retryable=True)

    @activity.defn(name="fetch_weights")
    async def fetch_weights(self, inp: FetchWeightsInput) -> FetchWeightsResult:
        """Fetch the profile's source into the cache, heartbeating progress (bytes, total)."""
        with self.agent.attempts.running():  # a crash's next boot retries it at once (node/attempts.py)
            return await self._fetch(inp)

    async def _fetch(self, inp: FetchWeightsInput, peers: list[Peer] | None = None) -> FetchWeightsResult:
        """`peers`: nodes holding these weights, tried before the mirror (issue 39; named by the control
        plane's answer to `start_shard`'s "still wanted?", or by a pre-staging fetch's input; a start in steps
        asks no one and takes the mirror)."""
        self._check_fence(inp.replica_id, inp.generation, "fetch weights")
        if peers is None:  # a pre-staging fetch names them in its input (workflows/stage.py)
            peers = [Peer(p.node_id, p.url) for p in inp.peers if p.node_id and p.url]
        # `moved_at`: when the download last made progress, carried across attempts in the heartbeat's details
        # (an attempt that is retried resumes from there): the bound on retrying it (`fetch_retry_s`).
        before = _details(activity.info().heartbeat_details) if activity.in_activity() else {}
        moved_at = before.get("moved_at")
        seen: dict = {"moved_at": moved_at if isinstance(moved_at, (int, float)) else time.time()}
        if isinstance(before.get("bytes"), int):
            seen["bytes"] = before["bytes"]  # a resumed download's first report is no progress

        def progress(n: int, total: int | None) -> None:
            # Called from the (possibly shared) download task: only record; this activity heartbeats, and
            # the agent's heartbeat carries it to the control plane (`ctl replicas` shows it).
            if n > seen.get("bytes", -1):
                seen["moved_at"] = time.time()
            seen.update(bytes=n, total=total)
            self.agent.download_progress(inp.replica_id, DownloadProgress(
                replica_id=inp.replica_id, source=inp.source or "", bytes=n, total=total))

        beat = asyncio.create_task(_keepalive(seen))
        try:
            got = await self.agent.fetcher.fetch(inp.source, progress, peers)
        except FetchError as exc:
            # What the disk holds changed (a partial removed, a disk found full): the next heartbeat carries
            # the inventory, so the planner judges this node's free disk anew before it places the retry
            # (issue 38: it had placed it on the full disk again, from a figure up to ten beats old).
            self.agent.cache_changed()
            still = time.time() - seen["moved_at"]
            if exc.retryable and still > self.agent.settings.fetch_retry_s:
                if activity.in_activity():
                    activity.heartbeat(dict(seen))
                raise expected_failure(f"{exc} (no progress for {still:.0f}s, more than fetch_retry_s)",
                                       "FetchError", False) from None
            if activity.in_activity():
                activity.heartbeat(dict(seen))  # what the retry resumes with (its `moved_at`)
            raise expected_failure(str(exc), "FetchError", exc.retryable) from None
        finally:
            beat.cancel()
            self.agent.download_progress(inp.replica_id, None)
        if got.fetched:
            self.agent.cache_changed(got.bytes, got.peer_bytes)
        self._fetched[got.path] = time.monotonic()  # in use from here: its launch is a moment (or a step) away
        return FetchWeightsResult(path=got.path, bytes=got.bytes, fetched=got.fetched, peers=list(got.peers) or None)

    @activity.defn(name="launch_shard")
    async def launch_shard(self, inp: LaunchShardInput) -> LaunchShardResult:
        """Start the engine for one shard, after the node's own policy check. Returns pid and endpoint."""
        return await self._launch(inp)

    @activity.defn(name="start_shard")
    async def start_shard(self, inp: StartShardInput) -> LaunchShardResult:
        """Fetch the weights, then launch: the one node step of a single-shard replica's start (issue 13).

        "Still wanted?" is asked here, of the control plane over the node API (no workflow step for it):
        before the fetch, which also gives the fencing generation the fetch and launch carry, and again
        after a fetch that downloaded anything or took longer than `RECHECK_AFTER_S`, so a replica stopped
        while it fetched is not launched even when the cancellation of this activity has not reached the
        node yet (heartbeats carry it, throttled); the fence refuses the rest. A retry finds the weights
        cached and the shard already running (adopted). A crash's next boot retries it at once
        (node/attempts.py), and the download resumes where it was."""
        with self.agent.attempts.running():
            return await self._start_shard(inp)

    async def _start_shard(self, inp: StartShardInput) -> LaunchShardResult:
        la, sup = inp.launch, self.agent.supervisor
        existing = sup.get(la.shard_id)
        if existing is not None and sup.poll(existing) is None:
            return await self._launch(la)  # a retry: adopted as it runs
        ans = await self._still_wanted(la, "fetching weights", self.agent.fetcher.missing_name(inp.source))
        la = la.model_copy(update={"generation": ans.generation})
        peers = [Peer(p.node_id, p.url) for p in ans.peers or () if p.node_id and p.url]
        began = time.monotonic()
        got = await self._fetch(FetchWeightsInput(replica_id=la.replica_id, source=inp.source, generation=la.generation),
                                peers)
        if got.fetched or time.monotonic() - began > RECHECK_AFTER_S:
            la = la.model_copy(update={"generation": (await self._still_wanted(la, "launching")).generation})
        return await self._launch(la.model_copy(update={"weights_path": got.path}))

    async def _still_wanted(self, la: LaunchShardInput, before: str, cache_name: str | None = None) -> LaunchCheckResponse:
        """The control plane's answer (the replica's fencing generation; with `cache_name`, the peers that hold
        it) if it says the replica is still `starting`; else fail the
        activity for good with `NotWanted` (its details: the replica's status, and `before`), or with
        `ControlPlaneUnreachable` when the node API does not answer (the start then takes its steps)."""
        try:
            ans = await self.agent.launch_wanted(la.shard_id, la.replica_id, cache_name=cache_name)
        except ReportRefused as exc:
            raise ApplicationError(f"node {self.agent.node_id}: the control plane refused to say whether shard "
                                   f"{la.shard_id} may start: {exc}", type="ReportRefused", non_retryable=True) from None
        except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
            # The node API is away (its process stopped, frozen, cut off): the start takes its steps instead,
            # which ask through the control worker and need no node API to launch (as before issue 13).
            log.warning("could not ask the control plane whether shard %s may start (%s); the start takes its steps",
                        la.shard_id, exc or type(exc).__name__)
            raise ApplicationError(f"node {self.agent.node_id} could not ask the control plane whether shard "
                                   f"{la.shard_id} may start: {exc or type(exc).__name__}", type=UNREACHABLE,
                                   non_retryable=True) from None
        if not ans.wanted:
            log.warning("did not start shard %s: its replica became %s before %s", la.shard_id, ans.status, before)
            raise ApplicationError(f"replica {la.replica_id} became {ans.status} before {before}", ans.status, before,
                                   type=NOT_WANTED, non_retryable=True)
        return ans

    async def _launch(self, inp: LaunchShardInput) -> LaunchShardResult:
        cdir = await compile_dir_for(self.agent, inp)  # the engine's compile cache, locked (node/compile_dirs.py)
        try:
            return await self._launch_with(inp, cdir)
        finally:
            if cdir is not None:
                cdir.release()  # the engine holds its own copy of the lock

    async def _launch_with(self, inp: LaunchShardInput, cdir: "CompileDir | None") -> LaunchShardResult:
        sup = self.agent.supervisor
        existing = sup.get(inp.shard_id)
        files = {}
        if inp.rank == 0 and inp.profile.adapters and not (existing is not None and sup.poll(existing) is None):
            self._check_fence(inp.replica_id, inp.generation, f"fetch adapters for shard {inp.shard_id}")
            files = await self._fetch_adapters(inp)
        # No await between this check and the launch: a stop (which fences first) cannot slip in between.
        self._check_fence(inp.replica_id, inp.generation, f"launch shard {inp.shard_id}")
        existing = sup.get(inp.shard_id)
        if existing is not None and sup.poll(existing) is None:
            return LaunchShardResult(shard_id=inp.shard_id, pid=existing.pid, endpoint=existing.endpoint, adopted=True)
        try:
            check_profile(inp.profile)  # again on the node: whatever sent the profile (seeds 003)
            adapter = self.agent.engines.get(inp.profile.engine)
            host = self.agent.advertise_host
            serving = inp.rank == 0
            spec = ShardSpec(shard_id=inp.shard_id, replica_id=inp.replica_id, model=inp.model, profile=inp.profile,
                             rank=inp.rank, gpus=inp.gpus, weights_path=inp.weights_path, host=host,
                             port=self._ports.take(host, {s.spec.port for s in sup.shards.values()}) if serving else 0,
                             rendezvous=inp.rendezvous,
                             api_key=new_api_key() if serving else None, sleep_mode=inp.sleep_mode,
                             adapter_files=files, compile_dir=str(cdir.path) if cdir else None)
            plan = adapter.build(spec)
        except (PolicyError, EngineError) as exc:
            raise ApplicationError(f"refused on node {self.agent.node_id}: {exc}", type=type(exc).__name__, non_retryable=True) from None
        shard = sup.launch(spec, plan, adapter.redact(plan.argv), (cdir.fd,) if cdir and cdir.fd is not None else ())
        self._watches.pop(inp.shard_id, None)
        await self._report(shard, ShardStatus.STARTING)
        self._watch(shard)  # after "starting": the agent's reports keep their order
        return LaunchShardResult(shard_id=inp.shard_id, pid=shard.pid, endpoint=shard.endpoint)

    async def _fetch_adapters(self, inp: LaunchShardInput) -> dict[str, AdapterFile]:
        """Fetch and verify each of the profile's adapters (issue 40) into the weight cache, as weights are
        (`Fetcher.fetch`: the mirror's sha256, a version's manifest). One that fails is recorded with its
        error and the replica starts without it: the gateway refuses its requests naming the cause, and the
        engine is never given it (llama.cpp's `--lora` ids count only the verified ones)."""
        files: dict[str, AdapterFile] = {}
        beat = asyncio.create_task(_keepalive({"adapters": len(inp.profile.adapters)})) if activity.in_activity() \
            else None
        try:
            for a in inp.profile.adapters:
                try:
                    got = await self._fetch_adapter(a.source)
                except FetchError as exc:
                    log.warning("adapter %s of replica %s not fetched: %s; the replica starts without it",
                                a.name, inp.replica_id, exc)
                    files[a.name] = AdapterFile(error=str(exc)[:2000])
                    continue
                if got.fetched:
                    self.agent.cache_changed(got.bytes)
                if got.path:
                    self._fetched[got.path] = time.monotonic()
                files[a.name] = AdapterFile(path=got.path)
        finally:
            if beat is not None:
                beat.cancel()
        if inp.profile.engine == "llamacpp":  # its `--lora` order: the verified ones, as the profile lists them
            ids = iter(range(len(files)))
            files = {k: f.model_copy(update={"id": next(ids)}) if f.path else f for k, f in files.items()}
        return files

    async def _fetch_adapter(self, source: str):
        """`Fetcher.fetch`, tried again after a passing failure (a dropped connection, a 5xx): an adapter that
        fails here stays out of the replica for its life. A verification failure is not tried again."""
        for wait in ADAPTER_FETCH_RETRIES_S:
            try:
                return await self.agent.fetcher.fetch(source)
            except FetchError as exc:
                if not exc.retryable:
                    raise
                log.info("fetching adapter %s failed (%s); again in %gs", source, exc, wait)
                await asyncio.sleep(wait)
        return await self.agent.fetcher.fetch(source)

    async def _report(self, shard, state: str) -> None:
        """Report a transition; a refusal by the control plane stops the shard and fails the activity for good
        (its endpoint is not at this node's address, or the shard is not placed here)."""
        try:
            await self.agent.report(shard.report(state))
        except ReportRefused as exc:
            await self.agent.supervisor.stop(shard.shard_id)
            raise ApplicationError(f"node {self.agent.node_id}: the control plane refused shard {shard.shard_id}: {exc}",
                                   type="ReportRefused", non_retryable=True) from None

    @activity.defn(name="open_rendezvous")
    async def open_rendezvous(self, inp: OpenRendezvousInput) -> Rendezvous:
        """Choose, on rank 0's node, where the shards of a multi-node replica meet (the engine decides how)."""
        self._check_fence(inp.replica_id, inp.generation, "open a rendezvous")
        try:
            adapter = self.agent.engines.get(inp.engine)
        except EngineError as exc:
            raise ApplicationError(f"refused on node {self.agent.node_id}: {exc}", type="EngineError", non_retryable=True) from None
        return adapter.open_rendezvous(self.agent.advertise_host, inp.replica_id, inp.world_size)

    @activity.defn(name="wait_shard_joined")
    async def wait_shard_joined(self, inp: WaitShardJoinedInput) -> WaitShardJoinedResult:
        """Wait until a worker shard (rank > 0) has joined rank 0; then it is Ready (it serves no HTTP of
        its own). Fails at once if the worker exits, so one dead shard fails the replica's start."""
        started = time.monotonic()
        with self.agent.attempts.running():  # an agent restart fails it at once (a retry resumes the wait)
            await self._await_ready(inp.shard_id, inp.timeout_s, "exited before it joined rank 0",
                                    "had not joined rank 0 after")
        return WaitShardJoinedResult(shard_id=inp.shard_id, waited_s=round(time.monotonic() - started, 2))

    @activity.defn(name="wait_shard_ready")
    async def wait_shard_ready(self, inp: WaitShardReadyInput) -> WaitShardReadyResult:
        """Wait until the engine is ready (its node watches from the launch on: `_watch`). Fails at once if
        the engine exits."""
        with self.agent.attempts.running():
            shard = await self._await_ready(inp.shard_id, inp.timeout_s, "exited before it was ready", "not ready after")
        return WaitShardReadyResult(shard_id=inp.shard_id, endpoint=shard.endpoint)

    async def _await_ready(self, shard_id: str, timeout_s: float, exited: str, late: str) -> "Shard":
        sup = self.agent.supervisor
        shard = sup.get(shard_id)
        if shard is None:
            raise ApplicationError(f"shard {shard_id} is not running on node {self.agent.node_id}", non_retryable=True)
        watch = self._watch(shard)
        started = time.monotonic() - _waited_before()  # a retry resumes the wait, not the whole timeout again
        while not watch.done():
            waited = time.monotonic() - started
            if waited > timeout_s:
                watch.cancel()
                raise ApplicationError(f"shard {shard_id} {late} {timeout_s:.0f}s", non_retryable=True)
            activity.heartbeat({"waiting_s": round(waited)})
            await asyncio.wait({watch}, timeout=min(1.0, max(0.0, timeout_s - waited) + 0.01))
        if watch.cancelled():  # stopped meanwhile, or another wait on it gave up
            raise ApplicationError(f"shard {shard_id} stopped being watched before it was ready (stopped, or its wait "
                                   "timed out)", non_retryable=True)
        if watch.result() is not None:  # raises what the watch raised (a refused report)
            what = f"engine for shard {shard_id}" if shard.spec.rank == 0 else f"worker shard {shard_id}"
            raise await self._exited(shard, f"{what} {exited}")
        return shard

    def _watch(self, shard: "Shard") -> asyncio.Task:
        """The task watching `shard` become ready, started when it was launched (or now, for a shard adopted
        after a restart). It does not wait for a workflow to ask: the moment the engine is ready (rank 0:
        its readiness check; a worker: joined rank 0), the shard is marked and reported ready, and the
        control plane routes the replica (readiness pushed, issue 13). Its result: None once ready, the
        exit code if the engine exited first."""
        watch = self._watches.get(shard.shard_id)
        if watch is None or watch.cancelled():
            watch = asyncio.get_running_loop().create_task(self._watch_ready(shard), name=f"ready {shard.shard_id}")
            watch.add_done_callback(_retrieve)
            self._watches[shard.shard_id] = watch
        return watch

    async def _watch_ready(self, shard: "Shard") -> int | None:
        sup = self.agent.supervisor
        adapter = self.agent.engines.get(shard.spec.profile.engine)
        cues = ReadinessCues(shard.log_path)
        async with aiohttp.ClientSession() as session:
            while True:
                code = sup.poll(shard)
                if code is not None:
                    return code
                if shard.spec.rank == 0:
                    if await adapter.is_ready(session, shard.endpoint, shard.spec.api_key):
                        break
                elif await adapter.joined(session, shard.spec):
                    break
                await cues.next()
        sup.set_state(shard, ShardStatus.READY)
        await self._report(shard, ShardStatus.READY)
        return None

    async def _exited(self, shard: "Shard", what: str) -> ApplicationError:
        """An engine exited while a start waited on it: report the shard failed with its decoded exit and
        output tail (kept on the shard row, whichever of this and the supervisor's watch reports first),
        and return the error that fails the start. The message's first line is the cause."""
        tail = self.agent.supervisor.tail(shard)
        why = self.agent.describe_exit(shard, tail)
        try:
            await self.agent.report(shard.report(ShardStatus.FAILED, tail=tail[-2000:], exit_reason=why))
        except ReportRefused:
            pass  # logged by the agent; the start fails with the cause either way
        text = f"{what}: {why}"
        if tail.strip():
            text += "\nlast output:\n" + tail.strip()[-1500:]
        return expected_failure(text, "EngineExited", retryable=False)

    @activity.defn(name="drain_shard")
    async def drain_shard(self, inp: DrainShardInput) -> DrainShardResult:
        """Wait until the engine has no request in flight (or `timeout_s`). Returns those still in flight. A
        retry (the agent restarted, Temporal was away) resumes the drain where its heartbeat left it
        (`draining_s`), not the whole timeout again nor the engine's stop early."""
        with self.agent.attempts.running():
            return DrainShardResult(in_flight=await self._drain(inp))

    async def _drain(self, inp: DrainShardInput) -> int:
        sup = self.agent.supervisor
        shard = sup.get(inp.shard_id)
        if shard is None or sup.poll(shard) is not None:
            return 0
        sup.set_state(shard, ShardStatus.DRAINING)
        adapter = self.agent.engines.get(shard.spec.profile.engine)
        before = _heartbeat_number("draining_s")
        started = time.monotonic() - before
        deadline = started + inp.timeout_s
        n: int | None = 0
        async with aiohttp.ClientSession() as session:
            # The gateways stop routing to a draining replica within their refresh interval; give them that.
            if not before:
                activity.heartbeat({"draining_s": 0})
                await asyncio.sleep(min(2.0, inp.timeout_s))
            while time.monotonic() < deadline:
                if sup.poll(shard) is not None:
                    return 0  # the engine is gone: nothing is in flight any more
                n = await adapter.in_flight(session, shard.endpoint, shard.spec.api_key)
                if not n:
                    return 0
                activity.heartbeat({"in_flight": n, "draining_s": round(time.monotonic() - started, 1)})
                await asyncio.sleep(0.5)
        return n or 0

    @activity.defn(name="sleep_shard")
    async def sleep_shard(self, inp: SleepShardInput) -> SleepShardResult:
        """Put rank 0's engine to sleep (issue 39), once what it serves has finished: its replica is already out
        of routing (sleeping), and the gateways stop sending within their refresh. Past `timeout_s` with
        requests still in flight it fails with `StillServing` and the engine stays awake (vLLM's sleep would
        abort them). The shard stays Ready on this node: its process runs on, asleep."""
        with self.agent.attempts.running():
            return await self._sleep(inp)

    async def _sleep(self, inp: SleepShardInput) -> SleepShardResult:
        sup = self.agent.supervisor
        shard = sup.get(inp.shard_id)
        if shard is None or sup.poll(shard) is not None:
            raise ApplicationError(f"shard {inp.shard_id} is not running on node {self.agent.node_id}",
                                   type="NotRunning", non_retryable=True)
        adapter = self.agent.engines.get(shard.spec.profile.engine)
        started = time.monotonic() - _heartbeat_number("waited_s")
        async with aiohttp.ClientSession() as session:
            if not _heartbeat_number("waited_s"):
                activity.heartbeat({"waited_s": 0})
                await asyncio.sleep(min(SLEEP_GRACE_S, inp.timeout_s))
            n: int | None = 0
            while True:
                if sup.poll(shard) is not None:
                    raise ApplicationError(f"shard {inp.shard_id} exited before it went to sleep", type="NotRunning",
                                           non_retryable=True)
                n = await adapter.in_flight(session, shard.endpoint, shard.spec.api_key)
                waited = time.monotonic() - started
                if not n:
                    break
                if waited >= inp.timeout_s:
                    raise ApplicationError(f"shard {inp.shard_id} still serves {n} request(s) after {waited:.0f}s: "
                                           "kept awake", type=STILL_SERVING, non_retryable=True)
                activity.heartbeat({"in_flight": n, "waited_s": round(waited, 1)})
                await asyncio.sleep(0.25)
            began = time.monotonic()
            try:
                await adapter.sleep(session, shard.endpoint, shard.spec.api_key, inp.level)
            except SleepError as exc:
                raise ApplicationError(f"shard {inp.shard_id} did not go to sleep: {exc}", type="SleepFailed",
                                       non_retryable=True) from None
        sup.set_asleep(shard, True)
        took = time.monotonic() - began
        log.info("shard %s asleep (level %d) in %.2fs", inp.shard_id, inp.level, took)
        return SleepShardResult(shard_id=inp.shard_id, took_s=round(took, 3), waited_s=round(began - started, 3))

    @activity.defn(name="wake_shard")
    async def wake_shard(self, inp: WakeShardInput) -> WakeShardResult:
        """Wake rank 0's sleeping engine (issue 39). Fenced like a launch: a node told to stop the replica at a
        later generation refuses, so a stop while it sleeps is never undone by a wake that came late."""
        replica_id = inp.replica_id or replica_of(inp.shard_id)
        self._check_fence(replica_id, inp.generation, f"wake shard {inp.shard_id}")
        sup = self.agent.supervisor
        shard = sup.get(inp.shard_id)
        if shard is None or sup.poll(shard) is not None:
            raise ApplicationError(f"shard {inp.shard_id} is not running on node {self.agent.node_id}",
                                   type="NotRunning", non_retryable=True)
        adapter = self.agent.engines.get(shard.spec.profile.engine)
        began = time.monotonic()
        async with aiohttp.ClientSession() as session:
            try:
                await adapter.wake(session, shard.endpoint, shard.spec.api_key)
            except SleepError as exc:
                raise ApplicationError(f"shard {inp.shard_id} did not wake: {exc}", type="WakeFailed") from None
        sup.set_asleep(shard, False)
        took = time.monotonic() - began
        log.info("shard %s awake in %.2fs", inp.shard_id, took)
        return WakeShardResult(shard_id=inp.shard_id, took_s=round(took, 3))

    @activity.defn(name="stop_shard")
    async def stop_shard(self, inp: StopShardInput) -> StopShardResult:
        """Fence the replica (on disk), then stop the shard's process group (SIGTERM, SIGKILL after `grace_s`).
        Its attempt is noted (node/attempts.py): an agent killed during the escalation, its engine ignoring
        SIGTERM, has the retry on its next boot at once, not after the 120 s timeout (issue 38).
        A fence that cannot be written (a full disk) does not keep the engine running: the stop goes on, and
        the activity then fails so that its retry records the fence (the stop workflow settles the replica
        either way, and the GPUs count as free)."""
        replica_id = inp.replica_id or replica_of(inp.shard_id)
        with self.agent.attempts.running():  # killed between SIGTERM and SIGKILL: the next boot retries it at once
            unfenced = self.agent.fences.record_before_stopping(replica_id, inp.generation, inp.shard_id)
            watch = self._watches.pop(inp.shard_id, None)
            if watch is not None:
                watch.cancel()
            was, code = await self.agent.supervisor.stop(inp.shard_id, inp.grace_s)
            await self.agent.report_stopped(inp.shard_id)
        if unfenced is not None:
            raise ApplicationError(f"stopped shard {inp.shard_id}, but could not record replica {replica_id}'s fence "
                                   f"on node {self.agent.node_id}: {unfenced}", type="FenceNotRecorded")
        return StopShardResult(shard_id=inp.shard_id, was_running=was, exit_code=code)

    @activity.defn(name="read_shard_log")
    async def read_shard_log(self, inp: ReadShardLogInput) -> ReadShardLogResult:
        """Part of a shard's engine log (its tail, or from an offset), for `llmgw ctl logs`."""
        try:
            out = await asyncio.to_thread(read_log, self.agent.supervisor.log_dir, self.agent.node_id, inp)
        except BadShardId as exc:
            raise ApplicationError(str(exc), type="BadShardId", non_retryable=True) from None
        shard = self.agent.supervisor.get(inp.shard_id)
        out.running = shard is not None and self.agent.supervisor.poll(shard) is None
        key = shard.spec.api_key if shard is not None else None
        if key and out.data:  # an engine that prints its key (SGLang logs its server_args): never sent on
            out.data = out.data.replace(key, ENGINE_KEY_SHOWN)
        return out

    @activity.defn(name="reclaim_cache")
    async def reclaim_cache(self, inp: NodeReclaimInput) -> NodeReclaimResult:
        """List or delete cache entries llmgw fetched that the catalog no longer wants; this node decides."""
        in_use = {s.spec.weights_path for s in self.agent.supervisor.running() if s.spec.weights_path}
        in_use |= {f.path for s in self.agent.supervisor.running() for f in s.spec.adapter_files.values() if f.path}
        # And what a start fetched lately: between its fetch and its launch (an await, or a workflow step
        # on the two-step path) the engine does not hold it yet, and its source may just have left the catalog.
        now = time.monotonic()
        for path, at in list(self._fetched.items()):
            if now - at < FETCHED_IN_USE_S:
                in_use.add(path)
            else:
                del self._fetched[path]
        result = await asyncio.to_thread(reclaim, self.agent.node_id, self.agent.cache_dir,
                                         set(inp.wanted), in_use, inp.collect)
        if result.removed:
            self.agent.cache_changed()
        return result


def _retrieve(task: asyncio.Task) -> None:
    """A readiness watch nobody awaited (its start gave up) still has its failure logged, once."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s: %s", task.get_name(), task.exception())


def _waited_before() -> float:
    """Seconds an earlier attempt of this activity had waited, from its last heartbeat (`waiting_s`)."""
    return _heartbeat_number("waiting_s")


def _heartbeat_number(key: str) -> float:
    """`key` of this activity's last heartbeat (an earlier attempt's), as seconds; 0 when there is none."""
    if not activity.in_activity():
        return 0.0
    details = activity.info().heartbeat_details
    try:
        return max(0.0, float(details[0][key])) if details else 0.0
    except (KeyError, TypeError, ValueError, IndexError):
        return 0.0


def _details(details) -> dict:
    """The last heartbeat's details of an earlier attempt (a dict), or {}."""
    try:
        first = details[0] if details else None
    except (IndexError, TypeError):
        return {}
    return first if isinstance(first, dict) else {}


async def _keepalive(progress: dict) -> None:
    """Heartbeat the download's progress (bytes, total) once a second, or just liveness."""
    while True:
        await asyncio.sleep(1)
        activity.heartbeat(dict(progress))
