"""The node worker's heartbeat loop outlives answers it cannot read (seeds: a control plane's failure must
never cost a healthy engine). A control plane is upgraded before its nodes, so an answer may carry fields
this node does not know; a broken proxy may answer 200 with a body that is not JSON, or not the schema. The
loop ending would end the agent, and with `--stop-engines-on-exit` every engine on the node. Here the real
loop talks to a small node API over real HTTP that answers each of those in turn."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from llmgw.config import Settings
from llmgw.dev.procs import free_port
from llmgw.node.agent import Agent
from llmgw.node.simulate import load_spec
from tests.fleet import sim_spec

ANSWERS = [
    {"ok": True, "reregister": False, "added_by_a_newer_control_plane": {"x": 1}},
    {"ok": "maybe"},  # not the schema
    "not json at all",  # a 200 whose body is not JSON
    {"ok": True, "reregister": False},
]


async def test_the_heartbeat_loop_outlives_answers_it_cannot_read(tmp_path):
    beats: list[int] = []
    registrations: list[dict] = []

    async def register(request: web.Request) -> web.Response:
        registrations.append(await request.json())
        return web.json_response({"node_id": "n1", "adopted": [], "stop": [], "a_newer_field": True})

    async def heartbeat(request: web.Request) -> web.Response:
        answer = ANSWERS[min(len(beats), len(ANSWERS) - 1)]
        beats.append(1)
        if isinstance(answer, str):
            return web.Response(text=answer, content_type="application/json")
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/node/v1/register", register)
    app.router.add_post("/node/v1/heartbeat", heartbeat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agent = Agent(Settings(state_dir=tmp_path, node_id="n1", node_api_url=f"http://127.0.0.1:{port}",
                           heartbeat_interval_s=0.05, reconnect_max_s=0.2),
                  simulate=load_spec(sim_spec(gpus=0)))
    agent.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
    loop = asyncio.create_task(agent.heartbeat_loop())
    try:
        for _ in range(200):
            if len(beats) >= len(ANSWERS) + 3 or loop.done():
                break
            await asyncio.sleep(0.05)
        assert not loop.done(), loop.exception() if loop.done() else None
        assert len(beats) >= len(ANSWERS) + 3  # it kept beating after each answer it could not read
        assert len(registrations) >= 3  # and registered again after each of the two
        assert json.dumps(registrations[0])  # a real registration body was sent
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await agent.http.close()
        await runner.cleanup()
