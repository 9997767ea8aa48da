"""`llmgw server`: the gateway (:8080) and the admin API (127.0.0.1:8081) in this process, and the node
API (:8443) in a process of its own that the server starts, restarts and stops.

Why the node API has its own process: node heartbeats keep every replica in routing (a node silent for
`node_unreachable_after_s`, 15 s, leaves it), so nothing a client does on the public port may delay them.
The listener limits (http/serving.py) bound what each connection can cost, but not what many can: a flood of
valid requests still fills one event loop, one database pool and one core's time slice. In a process of
its own the node API has its own loop, its own pool and its own share of the CPUs from the OS scheduler,
so a stalled or saturated gateway (shown with SIGSTOP in tests/test_listener_limits.py) leaves heartbeats
untouched. The cost is one more Python process (about 80 MB resident). `LLMGW_NODE_API_PORT=0` runs none,
for an operator who runs `llmgw node-api` as a service of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from llmgw.config import Settings
from llmgw.db.engine import async_engine
from llmgw.db.migrate import upgrade
from llmgw.dev.procs import port_open
from llmgw.control.admin import create_admin_api
from llmgw.gateway.app import Gateway, create_gateway_app
from llmgw.control.fleet_service import FleetService
from llmgw.control.nodeapi import Renewer, create_node_api, listen_refusal
from llmgw.control.revocations import DenyList
from llmgw.schemas.payloads import LivenessFacts
from llmgw.security.admin_token import ensure_token
from llmgw.http.gc_tuning import tune as tune_collector
from llmgw.http.serving import TLS, Listener, install_stop_handlers, listener_limits, serve
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)

CONTROL_BODY_BYTES = 16 << 20  # the admin and node APIs' request bodies (a catalog, a node's report)
# uvicorn's graceful shutdown of the gateway listener, after its drain (gateway/drain.py) has ended every open
# request: long enough for their last words (an error event) to be written, and for idle connections to close.
DRAIN_CLOSE_S = 5.0


def _run(coro) -> None:
    """Run on uvloop when it is installed: the measured difference on the relay's CPU time per request is
    about a quarter (bench/overhead.py)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux and macOS
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def main(settings: Settings, migrate: bool = True) -> None:
    _run(run_server(settings, migrate=migrate))


def node_api_main(settings: Settings) -> None:
    _run(run_node_api(settings))


async def run_server(settings: Settings, migrate: bool = True) -> None:
    url = settings.require_database_url()
    if settings.node_api_port and (why := listen_refusal(settings)):
        raise SystemExit(why)  # before anything listens: the gateway must not come up without its node API
    if migrate:
        await asyncio.to_thread(upgrade, url)
    raise_open_files_limit()
    token = ensure_token(settings)
    engine = async_engine(url, pool_size=10)
    gw = Gateway(settings, engine)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    listeners = [
        Listener(create_gateway_app(gw), settings.host, settings.gateway_port, "gateway",
                 limits=listener_limits(settings), graceful_s=DRAIN_CLOSE_S),
        Listener(create_admin_api(engine, gw.temporal, settings.node_unreachable_after_s, settings.node_lost_after_s,
                                  LivenessFacts(poller_grace_s=settings.poller_grace_s, silent_share=settings.silent_share),
                                  token=token, metrics=gw.metrics.render_tenants),
                 settings.admin_host, settings.admin_port, "admin", lifespan="off",
                 limits=listener_limits(settings, CONTROL_BODY_BYTES)),
    ]
    tune_collector(settings.gc_gen0_threshold)  # (after start-up: what exists now is frozen)
    log.info("gateway on %s:%d, admin on %s:%d (bearer token required; in %s unless LLMGW_ADMIN_TOKEN is set)",
             settings.host, settings.gateway_port, settings.admin_host, settings.admin_port, settings.admin_token_path)
    node_api = NodeAPIProcess(settings, stop) if settings.node_api_port else None
    try:
        if node_api is not None:
            await node_api.start()
        await serve(listeners, stop, before_close=gw.drain.drain)  # SIGTERM: the gateway drains first
    finally:
        if node_api is not None:
            await node_api.stop()
        await engine.dispose()


async def run_node_api(settings: Settings) -> None:
    """The node API alone: its own database pool and Temporal client (to wake the reconciler), and the
    deny-list of node certificates it re-reads every `revocation_refresh_s`."""
    if why := listen_refusal(settings):
        raise SystemExit(why)
    # Connections enough for a burst of heartbeats (every node at once after a network blip): beyond the pool
    # SQLAlchemy opens overflow connections and closes them on return, and that churn, a new Postgres
    # connection per heartbeat, was a tenth of the node API's CPU under load (bench/fleet.py).
    engine = async_engine(settings.require_database_url(), pool_size=32)
    temporal = LazyClient(settings)
    temporal.start()
    stop = asyncio.Event()
    install_stop_handlers(stop)
    watcher = asyncio.create_task(_stop_when_orphaned(stop))
    tls = deny = renewer = None
    background: list[asyncio.Task] = []
    if settings.node_api_tls:
        tls = TLS(str(settings.node_api_cert), str(settings.node_api_key), str(settings.ca_cert))
        deny = DenyList(engine, settings.revocation_refresh_s)
        if not await deny.first_load(stop):  # before listening: no request served as if nothing were revoked
            watcher.cancel()
            await temporal.close()
            await engine.dispose()
            return
        background.append(asyncio.create_task(deny.run(), name="deny-list"))
        ca_key = settings.resolved_ca_key
        if ca_key is not None:
            renewer = Renewer(settings.ca_cert, ca_key, settings.node_cert_days)  # type: ignore[arg-type]
        else:
            log.warning("no CA key (LLMGW_CA_KEY, or ca.key beside LLMGW_CA_CERT): nodes cannot renew their "
                        "certificates here, and each stops working when its certificate runs out")
    else:
        log.warning("the node API runs without mutual TLS: any client can claim to be any node. Configure "
                    "LLMGW_CA_CERT, LLMGW_NODE_API_CERT and LLMGW_NODE_API_KEY (llmgw ctl cert ...)")
    fleet = FleetService(engine, temporal, settings.node_unreachable_after_s)
    app = create_node_api(fleet, require_identity=tls is not None, deny=deny, renewer=renewer)
    tune_collector(settings.gc_gen0_threshold)
    log.info("node API on %s:%d (pid %d)", settings.host, settings.node_api_port, os.getpid())
    # The control plane's own sight of heartbeats (liveness: a blind observer declares nothing lost) is
    # kept where heartbeats arrive.
    observer = asyncio.create_task(fleet.observe_loop(min(settings.heartbeat_interval_s, 2.0),
                                                      settings.node_unreachable_after_s), name="observer")
    try:
        await serve([Listener(app, settings.host, settings.node_api_port, "node-api", lifespan="off", tls=tls,
                              limits=listener_limits(settings, CONTROL_BODY_BYTES))], stop)
    finally:
        observer.cancel()
        for task in background:
            task.cancel()
        watcher.cancel()
        await temporal.close()
        await engine.dispose()


async def _stop_when_orphaned(stop: asyncio.Event) -> None:
    """A node API started by `llmgw server` ends with it, even if the server was killed outright."""
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            log.warning("the server that started this node API is gone; stopping")
            stop.set()


class NodeAPIProcess:
    """`llmgw node-api` as a child of `llmgw server`: started before the server answers (the server fails
    if it cannot listen), restarted with back-off if it exits, stopped with the server."""

    def __init__(self, settings: Settings, stop: asyncio.Event):
        self.settings = settings
        self.server_stop = stop
        self.proc: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task | None = None
        self.stopping = False

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(sys.executable, "-m", "llmgw", "node-api",
                                                    stdin=asyncio.subprocess.DEVNULL)

    async def start(self, timeout_s: float = 60.0) -> None:
        self.proc = await self._spawn()
        port = self.settings.node_api_port
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::", "") else self.settings.host
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await asyncio.to_thread(port_open, port, host):
            if self.proc.returncode is not None:
                raise SystemExit(f"the node API exited with code {self.proc.returncode} before listening on {port}")
            if loop.time() > deadline:
                raise SystemExit(f"the node API did not listen on {port} within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)
        self.task = asyncio.create_task(self._supervise(), name="node-api")

    async def _supervise(self) -> None:
        delay = 1.0
        loop = asyncio.get_running_loop()
        while True:
            assert self.proc is not None
            started = loop.time()
            code = await self.proc.wait()
            await asyncio.sleep(0.5)  # a stop signal sent to the whole group reaches us too
            if self.stopping or self.server_stop.is_set():
                return
            if loop.time() - started > 60:
                delay = 1.0
            log.error("the node API process exited with code %s; restarting it in %.0fs", code, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
            if self.stopping or self.server_stop.is_set():
                return
            self.proc = await self._spawn()

    async def stop(self, grace_s: float = 10.0) -> None:
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one: each relayed request holds two sockets, and a
    soft limit of 1024 is common."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not POSIX, or not permitted
        pass
