"""Adapter for the built-in sim engine (`python -m llmgw.engines.sim_server`).

Single shard: one process serving HTTP. Multi-node: one process per shard with its `--rank`; workers get
no HTTP port and join rank 0 at the replica's rendezvous (`llmgw.engines.sim_group`); a worker has joined
when rank 0 lists its rank. The engine key goes in `LLMGW_SIM_API_KEY`; the sim engine then refuses every
request without it, `/health` included, so the node's own calls are held to it as the gateway's are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp

import llmgw

from llmgw.version import VERSION
from llmgw.engines.base import EngineAdapter, LaunchPlan, ShardSpec, auth_headers, launch_env
from llmgw.engines.sim_group import query_status


class SimAdapter(EngineAdapter):
    name = "sim"
    sleeps = True  # vLLM's calls, with the sleep and wake times `--sleep-s`/`--wake-s` give it (sim_server.py)
    sleep_path = "/sleep?level={level}"
    wake_path = "/wake_up"

    def engine_version(self) -> str:
        return VERSION  # the agent's own llmgw: the sim engine is its code

    def compile_env(self, directory: str | None) -> dict[str, str]:
        return {"LLMGW_SIM_COMPILE_DIR": directory} if directory else {}  # its `--compile-s` mark (sim_server.py)

    def build(self, spec: ShardSpec) -> LaunchPlan:
        argv = [sys.executable, "-m", "llmgw.engines.sim_server", *spec.profile.args, "--model", spec.model,
                "--host", spec.host]
        if spec.rendezvous is not None:
            argv += ["--rank", str(spec.rank), "--world-size", str(spec.world_size),
                     "--rendezvous", spec.rendezvous.address, "--token", spec.rendezvous.token]
        if not spec.is_worker:
            argv += ["--port", str(spec.port)]
        if spec.profile.max_loras:  # adapters loaded at run time, as vLLM's (sim_server.py)
            argv += ["--max-loras", str(spec.profile.max_loras)]
        # The sim engine is llmgw's own code: it runs the agent's llmgw (the same flags), wherever that is imported from.
        own = {"PYTHONPATH": str(Path(llmgw.__file__).resolve().parents[1])} | self.compile_env(spec.compile_dir)
        env = launch_env(spec, own | ({"LLMGW_SIM_API_KEY": spec.api_key} if spec.api_key else {}))
        endpoint = "" if spec.is_worker else f"http://{spec.host}:{spec.port}"
        return LaunchPlan(argv=argv, env=env, endpoint=endpoint)

    async def joined(self, session: aiohttp.ClientSession, spec: ShardSpec) -> bool:
        if spec.rendezvous is None:
            return True
        status = await query_status(spec.rendezvous.address)
        return bool(status) and status.get("token") == spec.rendezvous.token and spec.rank in status.get("joined", [])

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> int | None:
        try:
            async with session.get(endpoint + "/health", headers=auth_headers(api_key),
                                   timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return None
                return int((await r.json()).get("in_flight", 0))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
