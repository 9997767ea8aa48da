"""The fleet simulator (`llmgw sim-fleet`, issue 42): one process that plays N nodes for real.

Each simulated node is an ordinary node worker (`Agent`, with `--simulate`'s declared inventory) with its
own node id, its own certificate and key issued by the CA (so mutual TLS on the node API proves which node
speaks), its own shard, log, fence and cache directories; it registers, heartbeats, polls its own task
queue `node/<id>`, runs the node activities with their fencing and origin check, and reports every
transition over the node API, as `llmgw agent` does. What the N nodes share, to cost little CPU:

- one asyncio loop and one Temporal client: each node has its own `Worker` on its queue, polling with
  `pollers` (default 1) concurrent activity polls rather than the SDK's 5;
- one sim engine (engines/sim_shared.py): a sim shard is served on its own port inside this process, not
  spawned as a process per replica (node/sim_supervisor.py says what that changes);
- nothing of the node API's HTTP: each node presents its own client certificate, so its connections are
  its own (one kept-alive TLS connection per node), and on a loopback control plane each node has its own
  address (127.1.0.1 onwards: `own_addresses`), its connections' source and its engines' listening address,
  so the node API's per-address rules (the connection cap; an endpoint must be at the node's own address)
  apply per node as on N machines.

Not served per node: the worker's Prometheus metrics (`agent_metrics_port` is off: one process cannot bind
one port N times). The peer listener is each node's own, on a free port, as on a machine (`peer_port` -1
turns it off for all).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum

from llmgw.config import Settings
from llmgw.engines.registry import Engines
from llmgw.engines.sim_shared import SharedSimEngine
from llmgw.schemas.simulate import SimulatedNode
from llmgw.security.pki import NODE_ID_RE
from llmgw.temporal import connect, identity
from llmgw.node.agent import Agent
from llmgw.node.sim_supervisor import SharedEngineSupervisor
from llmgw.node.supervisor import Supervisor

log = logging.getLogger(__name__)
MAX_NODES = 5000  # more than one loop can heartbeat at the production interval (docs/operating.md, "Scaling out")
MAX_POLLERS = 8


class FleetError(ValueError):
    """The fleet cannot be simulated as asked (a count out of range, a node id refused, a missing certificate)."""


def node_ids(prefix: str, count: int) -> list[str]:
    """`prefix` + a zero-padded index, for `count` nodes (`sim-00` ... `sim-29`). Raises `FleetError`."""
    if not 1 <= count <= MAX_NODES:
        raise FleetError(f"--nodes must be from 1 to {MAX_NODES}, not {count}")
    width = max(2, len(str(count - 1)))
    ids = [f"{prefix}{i:0{width}d}" for i in range(count)]
    if not NODE_ID_RE.match(ids[-1]) or not NODE_ID_RE.match(ids[0]):
        raise FleetError(f"--node-prefix {prefix!r} makes node ids such as {ids[-1]!r}: use letters, digits, '.', "
                         "'_' and '-', starting with a letter or digit, up to 63 characters with the number")
    return ids


def loopback_address(index: int) -> str:
    """Node `index`'s own loopback address, 127.1.0.1 onwards (Linux routes all of 127/8 to the loopback)."""
    return f"127.{1 + index // 65024}.{index // 254 % 256}.{index % 254 + 1}"


def own_addresses(base: Settings) -> bool:
    """Whether each node gets an address of its own: when the node API and the advertised host are both on
    this machine's loopback, as in every local run. Then the control plane sees N peers, as from N machines
    (its per-client connection cap, 256, is per node again, and each node's endpoints are at its own
    address); else every node shares the machine's address (`advertise_host`)."""
    import ipaddress
    from urllib.parse import urlsplit

    def loopback(host: str | None) -> bool:
        try:
            return host == "localhost" or ipaddress.ip_address(host or "").is_loopback
        except ValueError:
            return False
    return loopback(urlsplit(base.resolved_node_api_url).hostname) and loopback(base.advertise_host)


def node_settings(base: Settings, node_id: str, certs: Path | None, address: str | None = None) -> Settings:
    """The settings of one simulated node: its id, its certificate and key from `certs` (`node-<id>.crt`
    and `.key`, as `llmgw ctl cert node` writes them), a weight cache of its own, no metrics port, and with
    `address`, that address for its engines and its peer listener (`own_addresses`)."""
    update: dict = {"node_id": node_id, "cache_dir": base.resolved_cache_dir / node_id, "agent_metrics_port": 0}
    if address is not None:
        update["advertise_host"] = address
    if certs is not None:
        update |= {"node_cert": certs / f"node-{node_id}.crt", "node_key": certs / f"node-{node_id}.key"}
    return base.model_copy(update=update)


def ensure_certificates(nodes: list[Settings], certs: Path | None, issue: bool) -> None:
    """Check every node has its certificate and key; with `issue`, issue those missing with the CA key in
    `certs` (a development PKI, as `llmgw dev` keeps). Raises `FleetError` naming what is missing."""
    if certs is None or not nodes[0].resolved_node_api_url.startswith("https://"):
        return
    missing = [s for s in nodes if not (s.node_cert and s.node_cert.exists() and s.node_key and s.node_key.exists())]
    if not missing:
        return
    if issue:
        from llmgw.security.pki import issue_node

        if not (certs / "ca.key").exists():
            where = "" if certs.is_dir() else " (no such directory)"
            raise FleetError(f"--issue-certs: no CA key in {certs}{where} (ca.key) to issue {len(missing)} node "
                             "certificate(s): pass --certs the directory that holds ca.key (by default the one of "
                             "LLMGW_CA_CERT), or issue them where the CA key is with `llmgw ctl cert node ID`")
        for s in missing:
            issue_node(certs, s.resolved_node_id, days=s.node_cert_days)
        return
    names = ", ".join(s.resolved_node_id for s in missing[:5]) + (" ..." if len(missing) > 5 else "")
    where = "" if certs.is_dir() else " (no such directory)"
    raise FleetError(f"no certificate in {certs}{where} for {len(missing)} node(s) ({names}): issue each with "
                     f"`llmgw ctl cert node ID --dir {certs}`, or pass --issue-certs to issue them with the CA key "
                     "there")


class FleetNode(Agent):
    """One simulated node of the fleet: an `Agent` whose sim engines run in the shared engine and whose
    Temporal worker uses the fleet's client with `pollers` activity polls."""

    def __init__(self, settings: Settings, fleet: "FleetSimulator", **kwargs):
        self.fleet = fleet  # before Agent's init: `make_supervisor` reads it
        super().__init__(settings, **kwargs)

    def make_engines(self) -> Engines:
        if self.fleet.engines is None:  # one machine's engines, looked for once (SGLang's check is a subprocess)
            self.fleet.engines = super().make_engines()
        return self.fleet.engines

    def make_supervisor(self, shard_dir: Path, log_dir: Path) -> Supervisor:
        return SharedEngineSupervisor(self.fleet.engine, shard_dir, log_dir, on_exit=self._on_exit,
                                      log_max_bytes=int(self.settings.engine_log_max_mb * (1 << 20)))

    async def temporal_client(self) -> Client:
        return await self.fleet.client()

    def connector_options(self) -> dict:
        if self.settings.advertise_host != self.fleet.base.advertise_host:  # its own address (`own_addresses`)
            return {"local_addr": (self.settings.advertise_host, 0)}
        return {}

    def worker_options(self) -> dict:
        return {"max_concurrent_activities": 64,
                "activity_task_poller_behavior": PollerBehaviorSimpleMaximum(maximum=self.fleet.pollers),
                "identity": f"{identity()} node {self.node_id}"}  # each node apart in Temporal's UI


class FleetSimulator:
    """N `FleetNode`s on one loop (module doc). `run(stop)` until `stop` is set. `start_rate`: nodes started
    per second (0: all at once; a thousand registrations at once had timed out on a 2-core control plane and
    come back in retries)."""

    def __init__(self, base: Settings, spec: SimulatedNode, count: int, prefix: str = "sim-",
                 certs: Path | None = None, issue_certs: bool = False, pollers: int = 1,
                 stop_engines_on_exit: bool = False, start_rate: float = 100.0):
        if not 1 <= pollers <= MAX_POLLERS:
            raise FleetError(f"--pollers must be from 1 to {MAX_POLLERS}, not {pollers}")
        if not 0 <= start_rate <= 100_000:
            raise FleetError(f"--start-rate must be from 0 (all at once) to 100000 nodes a second, not {start_rate:g}")
        self.start_rate = start_rate
        self.base = base
        self.pollers = pollers
        self.engine = SharedSimEngine()
        self.engines: Engines | None = None  # what the machine can launch, shared by every node
        if certs is None and base.ca_cert is not None:
            certs = base.ca_cert.parent  # where `llmgw ctl cert node` writes beside ca.crt
        own = own_addresses(base)
        settings = [node_settings(base, n, certs, loopback_address(i) if own else None)
                    for i, n in enumerate(node_ids(prefix, count))]
        _check_trust(base)
        ensure_certificates(settings, certs, issue_certs)
        self.nodes = [FleetNode(s, self, stop_engines_on_exit=stop_engines_on_exit, simulate=spec) for s in settings]
        self._client: asyncio.Task | None = None

    async def client(self) -> Client:
        """The fleet's one Temporal client, connected once (for as long as it takes) for every node."""
        if self._client is None:
            self._client = asyncio.get_running_loop().create_task(self._connect())
        return await asyncio.shield(self._client)

    async def _connect(self) -> Client:
        while True:
            try:
                return await connect(self.base)
            except SystemExit as exc:
                log.warning("%s; still trying (the nodes register and heartbeat meanwhile)", exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Run every node until `stop`; a node that fails is logged and the others go on. Then the shared
        engine closes (with `stop_engines_on_exit` each node has stopped and reported its own first)."""
        raise_open_files(len(self.nodes))
        log.info("simulating %d node(s) (%s ... %s) in process %s on %s", len(self.nodes), self.nodes[0].node_id,
                 self.nodes[-1].node_id, os.getpid(), socket.gethostname())
        tasks: list[asyncio.Task] = []
        up = asyncio.create_task(self._say_when_up(time.monotonic()), name="up")  # (not awaited: nodes may end first)
        try:
            for i, n in enumerate(self.nodes):
                if i and self.start_rate:  # N machines do not boot in one instant either
                    await asyncio.sleep(1 / self.start_rate)
                if stop.is_set():
                    break
                tasks.append(asyncio.create_task(n.run(stop), name=f"node {n.node_id}"))
                tasks[-1].add_done_callback(lambda t, node_id=n.node_id: _ended(node_id, t))
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in [*tasks, up]:
                t.cancel()
            await self.engine.close()
        if not stop.is_set():
            raise SystemExit("every simulated node ended (their errors are logged above)")

    async def _say_when_up(self, started: float) -> None:
        """Say once when every node has registered (a fleet's start is otherwise silent), and how to stop it."""
        await asyncio.gather(*(n.registered.wait() for n in self.nodes))
        log.info("all %d simulated nodes registered in %.1f s; Ctrl-C or SIGTERM stops them", len(self.nodes),
                 time.monotonic() - started)


def _ended(node_id: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("simulated node %s ended: %s", node_id, task.exception())


def _check_trust(base: Settings) -> None:
    """Refuse, saying what to set, a fleet whose nodes could not prove who they are or check what they are
    told: each would end at once with a message about the activity key, which is not what to fix."""
    dev_ca = base.state_dir / "pki" / "ca.crt"
    here = f" (this machine's `llmgw dev` keeps it at {dev_ca})" if dev_ca.is_file() else (
        f" (under `llmgw dev`: {dev_ca}, made at its first start)")
    if base.ca_cert is None:
        if base.accept_unsigned_node_activities:  # a plain-HTTP node API, its risks written out: as the agent
            return
        raise FleetError("no CA certificate: set LLMGW_CA_CERT to the control plane's ca.crt" + here + "; each "
                         "simulated node proves its identity with a certificate from that CA and checks every "
                         "activity with activity-signing.pub beside it")
    if not base.ca_cert.is_file():
        raise FleetError(f"LLMGW_CA_CERT={base.ca_cert}: no such file; set it to the control plane's ca.crt" + here)


def raise_open_files(nodes: int) -> None:
    """Lift this process's open-file limit to its hard limit: each node holds a few descriptors (its node-API
    connection, its peer listener, each replica's port) and a thousand nodes pass the usual soft 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard != resource.RLIM_INFINITY and hard < nodes * 4:
        log.warning("open files limited to %d: %d simulated nodes may run out (raise `ulimit -n`)", hard, nodes)
