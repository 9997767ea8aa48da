"""The node worker (`llmgw agent`): one per machine.

It discovers the hardware, registers with the control plane over the node API (inventory and every shard
it runs, none included), heartbeats, and polls its own Temporal task queue `node/<node_id>` for node
activities (fetch, launch, readiness, drain, stop). It supervises engine processes and reports every
transition, with the tail of the engine's output on failure. Engines keep running when the worker
exits (a restarted worker adopts them) unless it was started with `stop_engines_on_exit`; then it says it
is leaving (`/node/v1/leave`: its replicas lost, the node Unreachable until it registers again) and
reports each stop before it exits, so their replicas leave routing at once.

Its node certificate is short-lived (`node_cert_days`): at two thirds of its life the worker makes a new key,
has the node API sign a CSR for it (`POST /node/v1/renew`, over the current certificate), installs the pair
atomically and uses it for every new connection (node/renewal.py). A revoked certificate cannot renew: every
request over it is refused, and the worker says so in its log.

Requests to the node API go one at a time, each built when it is sent: a heartbeat lists the shards running
when it was built, and the control plane receives it before any later report, so a shard missing from a
heartbeat is one this node no longer runs (control/fleet_service.py compares them on every heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from pathlib import Path

import aiohttp
from temporalio.worker import Worker

from llmgw.node.activities import NodeActivities
from llmgw.config import Settings
from llmgw.engines.base import EngineError
from llmgw.engines.exits import UNKNOWN_EXIT, describe_exit, with_output
from llmgw.engines.registry import Engines
from llmgw.schemas.api import (
    HeartbeatRequest, HeartbeatResponse, LaunchCheckRequest, LaunchCheckResponse, LeaveRequest, LeaveResponse,
    RegisterRequest, RegisterResponse, ShardStatusRequest,
)
from llmgw.schemas.inventory import DownloadProgress, ShardReport
from llmgw.schemas.simulate import SimulatedNode
from llmgw.schemas.status import ShardStatus
from llmgw.temporal import connect
from llmgw.version import USER_AGENT
from llmgw.weights.download import Limits
from llmgw.weights.fetcher import Fetcher
from llmgw.node.attempts import Attempts, end_left
from llmgw.node.discovery import discover, discover_gpus
from llmgw.node.errors import ReportRefused
from llmgw.node.fences import Fences
from llmgw.node.health import EngineHealth
from llmgw.node.infiniband import discover_fabrics
from llmgw.telemetry import AgentMetrics
from llmgw.node.peer_server import PeerListener, client_context
from llmgw.node.simulate import simulated_inventory
from llmgw.node.renewal import renew_loop
from llmgw.node.supervisor import Shard, Supervisor
from llmgw.security.pki import finish_renewal
from llmgw.workflows.ids import parse_shard_id, replica_of
from llmgw.workflows.queues import node_queue

log = logging.getLogger(__name__)


class Agent:
    """One node worker. `simulate` (from `--simulate SPEC`) replaces hardware discovery's output."""

    def __init__(self, settings: Settings, stop_engines_on_exit: bool = False, simulate: SimulatedNode | None = None):
        self.settings = settings
        self.simulate = simulate
        self.node_id = settings.resolved_node_id
        self.boot_id = uuid.uuid4().hex
        self.stop_engines_on_exit = stop_engines_on_exit
        self.engines = self.make_engines()
        self.fetcher = Fetcher(settings.resolved_cache_dir, settings.resolved_mirror_url, Limits.from_settings(settings),
                               peer_tls=lambda: self._peer_client)
        self.peer_listener: PeerListener | None = None  # this node's cache, served to peers (issue 39)
        self._peer_client = None  # TLS to peers' listeners
        # The control plane takes peer fetch's fields (its registration answer said so): sent only then.
        self.peers_taken = False
        node_dir = settings.shard_dir / self.node_id
        self.supervisor = self.make_supervisor(node_dir, settings.state_dir / "logs" / self.node_id)
        self.fences = Fences(node_dir / "fences")
        self.attempts = Attempts(node_dir / "attempts")  # long activities running, for the next boot to end
        self._post_lock = asyncio.Lock()
        self.api = settings.resolved_node_api_url.rstrip("/")
        self.http: aiohttp.ClientSession | None = None
        self._ssl = None  # the TLS context of node-API connections (None: plain HTTP)
        self.registered = asyncio.Event()
        self.reregister = False  # a transition report did not get through: the next beat registers again
        self.inventory_dirty = False
        self.downloads: dict[str, DownloadProgress] = {}  # replica id -> weights being fetched for it
        self._stopping: dict[str, asyncio.Task] = {}  # shard id -> its stop the control plane asked for
        self._gpus = None
        self._fabrics = None
        self.metrics = AgentMetrics()
        self.origin_check: list = []  # node/origin.py, loaded when the agent runs
        self.metrics.watch_downloads(self.downloads)

    def make_engines(self) -> Engines:
        """The engines this machine can launch (found once per process in the fleet simulator)."""
        s = self.settings
        return Engines(s.llama_server, s.vllm, s.ray, s.sglang_python)

    def make_supervisor(self, shard_dir: Path, log_dir: Path) -> Supervisor:
        """The supervisor of this node's engines (the fleet simulator's nodes share one engine instead)."""
        return Supervisor(shard_dir, log_dir, on_exit=self._on_exit,
                          log_max_bytes=int(self.settings.engine_log_max_mb * (1 << 20)),
                          crash_after_spawn=self.settings.test_crash_after_spawn)

    # ---- what the node activities use (node/host.py) -------------------------------------------
    @property
    def advertise_host(self) -> str:
        return self.settings.advertise_host

    @property
    def cache_dir(self) -> Path:
        return self.settings.resolved_cache_dir

    @property
    def compile_cache_gb(self) -> float:
        return self.settings.compile_cache_gb

    def download_progress(self, replica_id: str, progress: DownloadProgress | None) -> None:
        if progress is None:
            self.downloads.pop(replica_id, None)
        else:
            self.downloads[replica_id] = progress

    def cache_changed(self, fetched_bytes: int = 0, peer_bytes: int = 0) -> None:
        self.inventory_dirty = True
        if fetched_bytes:
            self.metrics.fetched.inc(fetched_bytes)
        if peer_bytes:
            self.metrics.fetched_from_peers.inc(peer_bytes)

    # ---- node API ------------------------------------------------------------------------------
    def ssl_context(self):
        """Client TLS for the node API: trust only llmgw's CA, present this node's certificate."""
        s = self.settings
        if not self.api.startswith("https://"):
            log.warning("talking to the node API over plain HTTP (%s): this node's identity is not proven", self.api)
            return None
        if not (s.ca_cert and s.node_cert and s.node_key):
            raise SystemExit("the node API is https: set LLMGW_CA_CERT, LLMGW_NODE_CERT and LLMGW_NODE_KEY "
                             f"(llmgw ctl cert node {self.node_id})")
        import ssl

        if finish_renewal(s.node_cert, s.node_key):
            log.info("installed the certificate a renewal had left half-installed (%s)", s.node_cert)
        ctx = ssl.create_default_context(cafile=str(s.ca_cert))
        ctx.load_cert_chain(str(s.node_cert), str(s.node_key))
        self._ssl = ctx
        return ctx

    async def use_new_certificate(self) -> None:
        """Present the certificate now on disk (just renewed) on every new connection: reloaded into the TLS
        context, and the kept-alive connections made with the old one closed, between two requests."""
        s = self.settings
        assert self._ssl is not None and self.http is not None
        async with self._post_lock:
            self._ssl.load_cert_chain(str(s.node_cert), str(s.node_key))
            if self._peer_client is not None:
                self._peer_client.load_cert_chain(str(s.node_cert), str(s.node_key))
            if self.peer_listener is not None:
                self.peer_listener.reload()
                self.inventory_dirty = True  # a certificate now able to serve peers: advertised at once
            old, self.http = self.http, self._session()
        await old.close()

    def _session(self) -> aiohttp.ClientSession:
        # Its version goes in a header, not a body field: a control plane one release older reads node
        # bodies with unknown fields refused (before issue 38), while every version ignores a header it lacks.
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers={"User-Agent": USER_AGENT},
                                     connector=aiohttp.TCPConnector(ssl=self._ssl, **self.connector_options()))

    def connector_options(self) -> dict:
        """More options of the node-API connections (a simulated node's own source address: node/fleet_sim.py)."""
        return {}

    async def _post(self, path: str, body, timeout_s: float | None = None) -> dict:
        """POST one body (or what `body()` builds, at send time) to the node API; one request at a time.
        `timeout_s`: this request's own limit (else the session's 10 s)."""
        assert self.http is not None
        async with self._post_lock:
            data = (body() if callable(body) else body).model_dump_json()
            extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
            async with self.http.post(self.api + path, data=data, headers={"Content-Type": "application/json"},
                                      **extra) as r:
                if r.status >= 400:
                    text = (await r.text())[:300]
                    if 400 <= r.status < 500 and r.status not in (408, 429):
                        raise ReportRefused(f"node API {path}: HTTP {r.status}: {text}")
                    raise RuntimeError(f"node API {path}: HTTP {r.status}: {text}")
                return await r.json()

    def shard_reports(self, with_keys: bool = True) -> list[ShardReport]:
        return [s.report(with_key=with_keys) for s in self.supervisor.running()]

    def heartbeat_reports(self) -> list[ShardReport]:
        """Every shard this worker holds, an exited one included until its exit has been reported: what a
        heartbeat lists, and the control plane takes a shard missing from it as gone."""
        return [s.report(ShardStatus.FAILED if s.exit_code is not None else None, with_key=False)
                for s in list(self.supervisor.shards.values())]

    def inventory(self):
        inv = self._inventory()
        url = self.peer_listener.advertisable() if self.peer_listener is not None and self.peers_taken else None
        return inv.model_copy(update={"peer_url": url}) if url else inv

    def _inventory(self):
        if self.simulate is not None:
            inv = simulated_inventory(self.simulate, self.settings.resolved_cache_dir, self.engines.names(),
                                      self.fetcher.cached_names())
            self.metrics.set_gpus(inv.gpus)  # a simulated node's metrics describe what it declares
            return inv
        if self._gpus is None:
            # GPUs and adapters do not come and go while the worker runs: discovered once, reasons logged here,
            # on the machine whose operator can fix them.
            self._gpus = discover_gpus()
            if self._gpus[1]:
                log.info("discovery: %s", self._gpus[1])
            self._fabrics = discover_fabrics(self.settings.fabrics, self.settings.infiniband_sysfs)
            for note in self._fabrics[1]:
                log.warning("discovery: %s", note)
            self.metrics.set_gpus(self._gpus[0])
        return discover(self.settings.resolved_cache_dir, self.engines.names(), self.fetcher.cached_names(),
                        self._gpus, self._fabrics)

    async def register(self) -> None:
        inv = self.inventory()
        sent: list[RegisterRequest] = []

        def body() -> RegisterRequest:
            sent.append(RegisterRequest(node_id=self.node_id, boot_id=self.boot_id, inventory=inv,
                                        shards=self.shard_reports()))
            return sent[-1]
        resp = RegisterResponse.model_validate(await self._post("/node/v1/register", body))
        if resp.peers and not self.peers_taken:
            self.inventory_dirty = True  # the next beat advertises the peer listener
        self.peers_taken = resp.peers
        await self.stop_unwanted(resp.stop, "which it cannot identify or no longer wants")
        if not self.registered.is_set():
            for note in inv.notes:
                log.info("inventory: %s", note)
        self.registered.set()
        log.info("registered node %s (%d shard(s) running, engines: %s, GPUs: %d, fabrics: %s)", self.node_id,
                 len(sent[-1].shards), ", ".join(inv.engines), len(inv.gpus), ", ".join(f.name for f in inv.fabrics) or "none")

    async def stop_unwanted(self, shard_ids: list[str], why: str) -> None:
        """Fence and stop each shard the control plane asks this node to stop (on registration, or a heartbeat
        naming a shard whose replica has ended). A fence that cannot be written (a full disk) does not keep
        the engine running: it is stopped all the same, and the launch-check still refuses its replica.

        The fences are written here; the stops run beside the heartbeat loop, one task per shard (a shard
        already stopping is not stopped twice). Awaited, an engine that ignores SIGTERM held every heartbeat
        for its `grace_s` (issue 38): one such engine per registration, and the node went Unreachable with
        the healthy replicas it serves."""
        for shard_id in shard_ids:
            if shard_id in self._stopping:
                continue
            shard = self.supervisor.get(shard_id)
            replica_id = shard.spec.replica_id if shard else replica_of(shard_id)
            log.warning("control plane asks to stop shard %s, %s", shard_id, why)
            self.fences.record_before_stopping(replica_id, 0, shard_id)
            task = asyncio.create_task(self.supervisor.stop(shard_id), name=f"stop {shard_id}")
            self._stopping[shard_id] = task
            task.add_done_callback(lambda t, sid=shard_id: self._stopped_unwanted(sid, t))

    def _stopped_unwanted(self, shard_id: str, task: asyncio.Task) -> None:
        self._stopping.pop(shard_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("stopping shard %s failed: %s", shard_id, task.exception())

    async def report(self, report: ShardReport, attempts: int = 5) -> None:
        """Send one shard transition; retried briefly, then left to the next registration, which the next
        heartbeat makes (it carries every shard with its endpoint and engine key). Raises `ReportRefused`
        when the control plane refuses it (a shard not placed on this node, an endpoint not at its address)."""
        for attempt in range(attempts):
            try:
                await self._post("/node/v1/shards", ShardStatusRequest(node_id=self.node_id, boot_id=self.boot_id, shard=report))
                return
            except ReportRefused as exc:
                log.error("the control plane refused the report on shard %s: %s", report.shard_id, exc)
                raise
            except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
                log.warning("reporting shard %s failed (%s); retrying", report.shard_id, exc)
                await asyncio.sleep(0.5 * (attempt + 1))
        self.reregister = True

    async def launch_wanted(self, shard_id: str, replica_id: str, attempts: int = 2,
                            timeout_s: float = 3.0, cache_name: str | None = None) -> LaunchCheckResponse:
        """Ask the control plane whether `replica_id` is still wanted (`starting`) before fetching for or
        launching its shard `shard_id`. Raises `ReportRefused` when it refuses to answer this node (not its
        shard), and, after `attempts` of `timeout_s` each, the transport's error when it cannot be reached
        (nothing starts unasked: the start takes its steps, which ask through the control worker).
        `cache_name`: the weights it is about to fetch, asked of peers (the answer's `peers`)."""
        req = LaunchCheckRequest(node_id=self.node_id, shard_id=shard_id, replica_id=replica_id,
                                 cache_name=cache_name if self.peers_taken else None)
        for attempt in range(attempts - 1):
            try:
                return LaunchCheckResponse.model_validate(await self._post("/node/v1/launch-check", req, timeout_s))
            except ReportRefused:
                raise
            except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
                log.warning("asking whether shard %s may start failed (%s); retrying", shard_id, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        return LaunchCheckResponse.model_validate(await self._post("/node/v1/launch-check", req, timeout_s))

    async def leave(self, attempts: int = 2, timeout_s: float = 3.0) -> None:
        """Tell the control plane this node is leaving (`POST /node/v1/leave`); logged, never raised."""
        req = LeaveRequest(node_id=self.node_id, boot_id=self.boot_id)
        for attempt in range(attempts):
            try:
                resp = LeaveResponse.model_validate(await self._post("/node/v1/leave", req, timeout_s))
                log.info("told the control plane this node is leaving%s", f"; replicas {', '.join(resp.lost)} lost"
                         if resp.lost else "" if resp.known else " (it did not know this boot)")
                return
            except ReportRefused as exc:
                log.error("the control plane refused this node's goodbye: %s", exc)
                return
            except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:
                log.warning("saying goodbye to the control plane failed (%s)%s", exc,
                            "; retrying" if attempt + 1 < attempts else "")
                await asyncio.sleep(0.2)

    async def report_stopped(self, shard_id: str, attempts: int = 5) -> None:
        replica_id, rank = parse_shard_id(shard_id) or (shard_id, 0)
        try:
            await self.report(ShardReport(shard_id=shard_id, replica_id=replica_id, model="", profile="",
                                          rank=rank, state=ShardStatus.STOPPED), attempts)
        except ReportRefused:
            pass  # stopped is stopped; the refusal is logged

    def describe_exit(self, shard: Shard, tail: str = "") -> str:
        """How `shard`'s engine ended, in words (its adapter's), e.g. "killed by SIGILL (illegal instruction): ...",
        with the line of its last output `tail` that most likely says why ("exited with code 1: error while
        handling argument ...")."""
        if shard.proc is None:  # adopted: not our child, so its exit status cannot be read
            return UNKNOWN_EXIT
        try:
            reason = self.engines.get(shard.spec.profile.engine).describe_exit(shard.exit_code)
        except EngineError:  # an engine no longer installed here: the generic words
            reason = describe_exit(shard.exit_code)
        return with_output(reason, tail, signalled=(shard.exit_code or 0) < 0)

    async def _on_exit(self, shard: Shard, tail: str) -> None:
        try:
            await self.report(shard.report(ShardStatus.FAILED, tail=tail[-2000:], exit_reason=self.describe_exit(shard, tail)))
        except ReportRefused:
            pass  # logged; the next registration reports the shard gone

    async def _on_unresponsive(self, shard: Shard, cause: str) -> None:
        """A Ready engine stopped answering (node/health.py): its replica fails with the cause, now."""
        try:
            await self.report(shard.report(ShardStatus.FAILED, tail=self.supervisor.tail(shard)[-2000:], exit_reason=cause))
        except ReportRefused:
            pass  # logged; the heartbeat no longer lists it once it is stopped

    async def heartbeat_loop(self) -> None:
        """Register, then heartbeat. Re-register after the control plane forgets us or comes back."""
        delay = 1.0
        need_register = True
        beats = 0
        while True:
            try:
                if need_register or self.reregister:
                    self.reregister = False
                    await self.register()
                    need_register = False
                beats += 1
                # The inventory rides along every 10th beat, or at once after a fetch changed the cache.
                inv = self.inventory() if beats % 10 == 0 or self.inventory_dirty else None
                self.inventory_dirty = False
                resp = HeartbeatResponse.model_validate(await self._post("/node/v1/heartbeat", lambda: HeartbeatRequest(
                    node_id=self.node_id, boot_id=self.boot_id, shards=self.heartbeat_reports(), inventory=inv,
                    downloads=list(self.downloads.values()))))
                need_register = resp.reregister
                await self.stop_unwanted(resp.stop or [], "whose replica has ended (its stop did not reach this node)")
                delay = 1.0
                await asyncio.sleep(self.settings.heartbeat_interval_s)
            except Exception as exc:  # noqa: BLE001 - this loop ending would end the agent (and every engine
                # with --stop-engines-on-exit): an answer it cannot read or an inventory that failed is retried
                # like an unreachable control plane. A control-plane restart must not need a touch on every
                # node, and a fleet must not reconnect in lockstep: jittered backoff, then a fresh registration.
                if isinstance(exc, (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError)):
                    log.warning("control plane unreachable at %s (%s); retrying in %.0fs", self.api, exc, delay)
                else:
                    log.exception("heartbeat failed (%s: %s); registering again in %.0fs", type(exc).__name__, exc,
                                  delay)
                need_register = True
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.settings.reconnect_max_s)

    async def _stop_engines(self) -> None:
        """Say the node is leaving, then stop every engine and report each stop before exiting: its replicas
        leave routing now, rather than when the node is judged silent (issue 9), they end as lost by this
        node's exit (a peer rank on another node, losing its partner, would otherwise fail them first with
        its own exit), and nothing more is placed here until the node registers again. Each request is
        tried twice, briefly; a control plane that does not answer learns it from the next registration."""
        ids = list(self.supervisor.shards)
        if self.http is not None:
            await self.leave()
        log.info("stopping %d engine(s)", len(ids))
        await self.supervisor.stop_all()
        if self.http is not None:
            for shard_id in ids:
                await self.report_stopped(shard_id, attempts=2)

    # ---- main ----------------------------------------------------------------------------------
    async def temporal_client(self):
        """Connect to Temporal, for as long as it takes (the fleet simulator's nodes share one client)."""
        while True:
            try:
                return await connect(self.settings)
            except SystemExit as exc:
                log.warning("%s; still trying (the node API is served meanwhile: this node registers and "
                            "heartbeats)", exc)

    def worker_options(self) -> dict:
        """Options of this node's Temporal worker beyond its queue and activities."""
        return {"max_concurrent_activities": 64}

    async def _temporal_worker(self, started: list[Worker]) -> None:
        """Connect to Temporal (for as long as it takes), then poll this node's task queue until shut down."""
        client = await self.temporal_client()
        try:  # what a crashed predecessor left running is retried now, not after its heartbeat timeout
            await end_left(client, self.attempts, self.node_id)
        except Exception:  # noqa: BLE001 - only the quick retry is lost; the worker must poll
            log.exception("ending the attempts a previous boot left failed; they wait for their heartbeat timeout")
        worker = Worker(client, task_queue=node_queue(self.node_id), activities=NodeActivities(self).all(),
                        interceptors=self.origin_check, **self.worker_options())
        started.append(worker)
        log.info("node worker %s polling %s", self.node_id, node_queue(self.node_id))
        await worker.run()

    def load_origin_check(self) -> list:
        """The check of every activity's origin (node/origin.py), from `activity_verify_key` (or the key beside
        the CA). With none, the node refuses to start unless `accept_unsigned_node_activities` is set."""
        from llmgw.node.origin import OriginCheck
        from llmgw.security.activity_origin import Verifier, load_public_keys

        path = self.settings.resolved_activity_verify_key
        if path is None:
            if not self.settings.accept_unsigned_node_activities:
                raise SystemExit(
                    "no key to check node activities with: set LLMGW_ACTIVITY_VERIFY_KEY to the control plane's "
                    "activity-signing.pub (`llmgw ctl cert ca` makes it beside ca.crt; copy it to the node with "
                    "ca.crt), or LLMGW_ACCEPT_UNSIGNED_NODE_ACTIVITIES=true to let anyone who reaches Temporal "
                    "command this node")
            log.warning("node %s runs unsigned activities: anyone who reaches Temporal can stop, start and read "
                        "its engines (LLMGW_ACCEPT_UNSIGNED_NODE_ACTIVITIES)", self.node_id)
            return []
        try:
            keys = load_public_keys(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"cannot load the activity verify key {path}: {exc}") from None
        return [OriginCheck(Verifier(keys), self.node_id,
                            lambda activity, reason: self.metrics.refused_activities.labels(activity, reason).inc())]

    def _start_peer_listener(self) -> asyncio.Task | None:
        why = PeerListener.wanted(self.settings)
        if why is not None:
            log.info("serving no peers: %s", why)
            return None
        self._peer_client = client_context(self.settings)
        listener = PeerListener(self.settings, self.settings.resolved_cache_dir)
        if not listener.bind():
            return None
        self.peer_listener = listener
        return asyncio.create_task(listener.run(), name="peers")

    async def run(self, stop: asyncio.Event) -> None:
        self.origin_check = self.load_origin_check()
        log.info("node %s launches %s", self.node_id, self.engines.describe())
        adopted, dead = self.supervisor.adopt_all()
        if adopted or dead:
            log.info("adopted %d running shard(s); %d were gone", len(adopted), len(dead))
        self.fences.prune()
        if self.settings.agent_metrics_port:
            self.metrics.serve(self.settings.agent_metrics_port, self.settings.host)
        self.ssl_context()
        self.http = self._session()
        peer_task = self._start_peer_listener()
        health = EngineHealth(self.supervisor, self.engines, self.settings.engine_probe_interval_s,
                              self.settings.engine_probe_failures, self._on_unresponsive)
        workers: list[Worker] = []
        # The node API first, Temporal when it answers: an agent restarted while Temporal is away still
        # registers, adopts its engines and heartbeats (one liveness witness stays alive), rather than
        # waiting a minute for Temporal and then exiting.
        tasks = [asyncio.create_task(self._temporal_worker(workers), name="worker"),
                 asyncio.create_task(self.supervisor.watch(), name="watch"),
                 asyncio.create_task(self.heartbeat_loop(), name="heartbeat"),
                 asyncio.create_task(health.run(), name="health")]
        if self._ssl is not None:
            tasks.append(asyncio.create_task(renew_loop(self), name="renewal"))
        if peer_task is not None:
            tasks.append(peer_task)
        try:
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopper and t.exception():
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in tasks[1 if workers else 0:]:
                t.cancel()
            if self.stop_engines_on_exit:
                await self._stop_engines()
            for worker in workers:
                try:
                    await asyncio.wait_for(worker.shutdown(), 10)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            await self.http.close()
