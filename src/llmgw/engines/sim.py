"""Adapter for the built-in sim engine (`python -m llmgw.engines.sim_server`)."""

from __future__ import annotations

import sys

import aiohttp

from llmgw.engines.base import EngineAdapter, LaunchPlan, ShardSpec, base_env


class SimAdapter(EngineAdapter):
    name = "sim"

    def build(self, spec: ShardSpec) -> LaunchPlan:
        argv = [sys.executable, "-m", "llmgw.engines.sim_server", "--host", spec.host, "--port", str(spec.port),
                "--model", spec.model, *spec.profile.args]
        env = base_env(spec) | dict(spec.profile.env)
        return LaunchPlan(argv=argv, env=env, endpoint=f"http://{spec.host}:{spec.port}")

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str) -> int | None:
        try:
            async with session.get(endpoint + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return int((await r.json()).get("in_flight", 0))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
