"""What every engine adapter provides: argv and env for one shard, and how to tell it is ready.

Adapters never build a shell string: argv is a list handed to `exec`. The environment starts empty
apart from a few neutral variables; profile env is added only after the policy check.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import aiohttp

from llmgw.engines.exits import describe_exit
from llmgw.schemas.catalog import Profile
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


def base_env(spec: ShardSpec) -> dict[str, str]:
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return env


def reserve_port(host: str) -> int:
    """A port free on `host` now (bound and released; the engine binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


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

    def describe_exit(self, code: int | None) -> str:
        """How this engine's process ended, with the likely cause: "killed by SIGILL (illegal instruction):
        ...", "exited with code 1". Used in every failure the node reports."""
        return describe_exit(code, self.exit_hints)

    def build(self, spec: ShardSpec) -> LaunchPlan:
        raise NotImplementedError

    def open_rendezvous(self, host: str, replica_id: str, world_size: int) -> Rendezvous:
        """Choose where the shards of a multi-node replica meet; runs on rank 0's node. Default: a port
        free on `host`. An engine that must start something first (a Ray head) does it here."""
        return Rendezvous(address=f"{host}:{reserve_port(host)}", world_size=world_size, token=replica_id)

    async def joined(self, session: aiohttp.ClientSession, spec: ShardSpec) -> bool:
        """Whether worker shard `spec` (running) has joined its group. Default: True, for engines whose
        rank 0 does not become ready until every rank has joined, so rank 0's readiness is the proof."""
        return True

    async def is_ready(self, session: aiohttp.ClientSession, endpoint: str) -> bool:
        try:
            async with session.get(endpoint + self.health_path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str) -> int | None:
        """Requests the engine is processing now, or None when it cannot say."""
        return None
