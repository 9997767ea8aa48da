"""What every engine adapter provides: argv and env for one shard, and how to tell it is ready.

Adapters never build a shell string: argv is a list handed to `exec`. The environment starts empty
apart from a few neutral variables; profile env is added only after the policy check, and the node
worker's own variables are merged over it, as its own flags come after the profile's (argparse and
llama.cpp take the last occurrence): whatever a profile says, the worker's GPUs, address, port and
engine key win (issue 11).

Engine key: every serving shard gets a random API key from its node (`ShardSpec.api_key`), passed through
the engine's environment where the engine reads one (vLLM `VLLM_API_KEY`, llama-server `LLAMA_API_KEY`, the
sim engine `LLMGW_SIM_API_KEY`; a process's environment is readable only by its user, its argv by
everyone), else as `--api-key` (SGLang reads no variable). The engine refuses a request without it; the
gateway and the node's own calls (readiness, in-flight, drain) send it as `Authorization: Bearer`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from llmgw.engines.exits import describe_exit
from llmgw.schemas.catalog import Profile
from llmgw.schemas.inventory import AdapterFile
from llmgw.schemas.payloads import Rendezvous

BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")


@dataclass
class ShardSpec:
    """Everything needed to launch (and later identify) one shard. Written to the shard's spec file."""

    shard_id: str
    replica_id: str
    model: str
    profile: Profile
    rank: int = 0
    gpus: list[int] = field(default_factory=list)
    weights_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    rendezvous: Rendezvous | None = None  # multi-node replicas: where the shards meet (rank 0's node)
    api_key: str | None = field(default=None, repr=False)  # the engine's key (serving shards); see module doc
    sleep_mode: bool = False  # launched able to sleep (its model has `scaling.sleep_after`; issue 39)
    # The profile's adapters as the node fetched and verified them, by name (issue 40; node/activities.py).
    adapter_files: dict[str, AdapterFile] = field(default_factory=dict)
    # The directory of the engine's compile and kernel caches for this shard's key (engines/compile_cache.py),
    # given to it by `EngineAdapter.compile_env`; None: the engine's own default.
    compile_dir: str | None = None

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size if self.rendezvous else 1

    @property
    def is_worker(self) -> bool:
        """A shard of rank > 0: it joins rank 0 and serves no HTTP of its own."""
        return self.rank > 0


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    endpoint: str  # base URL the gateway proxies to (rank 0), e.g. http://127.0.0.1:40123; "" for a worker


class EngineError(ValueError):
    """The profile cannot be launched on this node (missing binary, missing weights, ...)."""


class SleepError(RuntimeError):
    """The engine did not go to sleep or wake (no sleep mode, an error answer, no answer)."""


def weights_argument(spec: ShardSpec, needs: str) -> str:
    """`spec.weights_path` as the engine's model argument: present, and never one that the engine's parser would
    read as a flag (a source is checked when the catalog is applied and on the node; this is the last gate)."""
    if not spec.weights_path:
        raise EngineError(f"profile for {spec.model} has no source; {needs}")
    if spec.weights_path.startswith("-"):
        raise EngineError(f"profile for {spec.model}: its weights {spec.weights_path!r} begin with '-', which the "
                          "engine would read as a flag; write a model id, a URL or a path as its source")
    return spec.weights_path


def new_api_key() -> str:
    """A fresh engine key: 256 random bits, URL-safe (43 characters)."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header the engine wants with its key, or none for an engine started without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def base_env(spec: ShardSpec) -> dict[str, str]:
    """The neutral variables every engine gets, and exactly the GPUs placement chose (none for a CPU shard:
    an empty CUDA_VISIBLE_DEVICES hides every card, so a CPU profile cannot take one nobody gave it)."""
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return env


def launch_env(spec: ShardSpec, worker: dict[str, str] | None = None) -> dict[str, str]:
    """Profile env (already checked by the policy), then the worker's: `base_env`, the collectives'
    interface for a multi-node shard, and `worker` (the engine key's variable, ...). Later wins."""
    env = dict(spec.profile.env) | base_env(spec)
    if spec.rendezvous is not None:
        iface = interface_of(spec.host)
        if iface:
            # NCCL's and Gloo's own sockets stay on the advertised address's interface ("=" means exact).
            env |= {"NCCL_SOCKET_IFNAME": f"={iface}", "GLOO_SOCKET_IFNAME": iface}
    return env | (worker or {})


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address `host` (an IP or a resolvable name), or None."""
    import psutil

    try:
        addrs = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return None
    for name, snics in psutil.net_if_addrs().items():
        for snic in snics:
            try:
                if ipaddress.ip_address(snic.address.split("%")[0]) in addrs:
                    return name
            except ValueError:
                continue
    return None


def reserve_port(host: str) -> int:
    """A port free on `host` now (bound and released; the engine binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


class Ports:
    """The ports this node handed to engines: one free now (`reserve_port`) that no live shard has and none
    handed out in the last `hold_s` (an engine binds its port only once it has loaded its model, minutes
    later for SGLang: meanwhile the kernel hands the same free port out again, a few times in a thousand
    here, and two shards started together could get one port and each other's readiness)."""

    def __init__(self, hold_s: float = 900.0, reserve: Callable[[str], int] = reserve_port):
        self.hold_s = hold_s
        self.reserve = reserve
        self.handed: dict[int, float] = {}

    def take(self, host: str, in_use: set[int]) -> int:
        now = time.monotonic()
        self.handed = {p: t for p, t in self.handed.items() if now - t < self.hold_s}
        for _ in range(100):
            port = self.reserve(host)
            if port not in in_use and port not in self.handed:
                self.handed[port] = now
                return port
        raise EngineError(f"no free port on {host} that no engine of this node holds or was given lately")


class EngineAdapter:
    """Base adapter. Subclasses set `name` and implement `build`; readiness defaults to GET /health.

    Multi-node replicas (the rendezvous protocol, run by `ReplicaStartWorkflow`):
    1. `open_rendezvous` runs on rank 0's node before anything launches and returns the address every
       shard is given (default: a free port on the node's advertised host);
    2. `build` is called for the workers (rank > 0, `spec.rendezvous` set), which are launched first, then
       for rank 0;
    3. `joined` is polled on each worker's node until the worker is part of the group; `is_ready` on
       rank 0's node, whose HTTP endpoint is the replica's.
    An engine plugs in by choosing what the address is (SGLang: `--dist-init-addr`, with `--nnodes` and
    `--node-rank`; vLLM: the Ray head's port, the workers running `ray start --address` and rank 0 starting
    the head before `vllm serve`) and how a joined worker is recognised.
    """

    name = "base"
    health_path = "/health"
    # Engine-specific causes for a signal that killed the engine (see `describe_exit`).
    exit_hints: dict[int, str] = {}

    def executable(self) -> str:
        """What this node will run for the engine, for the agent's start-up line."""
        return "built in"

    def describe_exit(self, code: int | None) -> str:
        """How this engine's process ended, with the likely cause: "killed by SIGILL (illegal instruction):
        ...", "exited with code 1". Used in every failure the node reports."""
        return describe_exit(code, self.exit_hints)

    def build(self, spec: ShardSpec) -> LaunchPlan:
        raise NotImplementedError

    def compile_env(self, directory: str | None) -> dict[str, str]:
        """The variables that point the engine's compile and kernel caches at `directory` (a key's directory,
        engines/compile_cache.py); {} for None or an engine that keeps none. Names per engine: that module's doc."""
        return {}

    def engine_version(self) -> str:
        """This node's version of the engine, for the compile cache's key; "" when it cannot tell. May run the
        engine's Python (a fraction of a second, once per adapter): call it off the event loop."""
        return ""

    def redact(self, argv: list[str]) -> list[str]:
        """`argv` with any engine key replaced, for logs."""
        return ["<engine key>" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]

    def open_rendezvous(self, host: str, replica_id: str, world_size: int) -> Rendezvous:
        """Choose where the shards of a multi-node replica meet; runs on rank 0's node. Default: a port
        free on `host`. An engine that must start something first (a Ray head) does it here."""
        return Rendezvous(address=f"{host}:{reserve_port(host)}", world_size=world_size, token=replica_id)

    async def joined(self, session: aiohttp.ClientSession, spec: ShardSpec) -> bool:
        """Whether worker shard `spec` (running) has joined its group. Default: True, for engines whose
        rank 0 does not become ready until every rank has joined, so rank 0's readiness is the proof."""
        return True

    async def is_ready(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> bool:
        try:
            async with session.get(endpoint + self.health_path, headers=auth_headers(api_key),
                                   timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> int | None:
        """Requests the engine is processing now, or None when it cannot say."""
        return None

    # ---- sleep (issue 39): keep the process, release the accelerator memory ----------------------------
    # `sleeps` says whether the engine has a sleep mode (`schemas.catalog.SLEEPING_ENGINES` lists the same);
    # the planner never puts an engine without one to sleep. `sleep_path`/`wake_path` are its HTTP calls,
    # made with the engine key like every other call the node makes.
    sleeps = False
    sleep_path = ""
    wake_path = ""
    sleep_timeout_s = 120.0  # a sleep or a wake copies the weights between GPU and host memory

    async def sleep(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None,
                    level: int = 1) -> None:
        """Put the engine to sleep at `level` (1: weights kept in host memory; 2: dropped); SleepError if it
        did not."""
        if not self.sleeps:
            raise SleepError(f"{self.name} has no sleep mode")
        await self._call(session, endpoint + self.sleep_path.format(level=level), api_key, "sleep")

    async def wake(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> None:
        """Wake the engine (its memory taken back, ready to serve); SleepError if it did not."""
        if not self.sleeps:
            raise SleepError(f"{self.name} has no sleep mode")
        await self._call(session, endpoint + self.wake_path, api_key, "wake")

    def _body(self, what: str) -> dict | None:
        """The JSON body of a sleep or wake call (None: none)."""
        return None

    async def _call(self, session: aiohttp.ClientSession, url: str, api_key: str | None, what: str) -> None:
        try:
            async with session.post(url, headers=auth_headers(api_key), json=self._body(what),
                                    timeout=aiohttp.ClientTimeout(total=self.sleep_timeout_s)) as r:
                text = (await r.text())[:300]
                if r.status != 200:
                    hint = (f"; {self.name} serves no {what} call here (started without its sleep mode?)"
                            if r.status in (404, 405) else "")
                    raise SleepError(f"{what} answered {r.status}: {text}{hint}")
                if what == "wake" and '"sleeping"' in text:  # vLLM: {"status": "sleeping"}, partly awake
                    raise SleepError(f"wake answered {text}: still asleep")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SleepError(f"{what} got no answer: {exc or type(exc).__name__}") from None
