"""What every engine adapter provides: argv and env for one shard, and how to tell it is ready.

Adapters never build a shell string: argv is a list handed to `exec`. The environment starts empty
apart from a few neutral variables; profile env is added only after the policy check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import aiohttp

from llmgw.schemas.catalog import Profile

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


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    endpoint: str  # base URL the gateway proxies to (rank 0), e.g. http://127.0.0.1:40123


class EngineError(ValueError):
    """The profile cannot be launched on this node (missing binary, missing weights, ...)."""


def base_env(spec: ShardSpec) -> dict[str, str]:
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return env


class EngineAdapter:
    """Base adapter. Subclasses set `name` and implement `build`; readiness defaults to GET /health."""

    name = "base"
    health_path = "/health"

    def build(self, spec: ShardSpec) -> LaunchPlan:
        raise NotImplementedError

    async def is_ready(self, session: aiohttp.ClientSession, endpoint: str) -> bool:
        try:
            async with session.get(endpoint + self.health_path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str) -> int | None:
        """Requests the engine is processing now, or None when it cannot say."""
        return None
