"""Sleeping replicas through the whole control plane (issue 39): a real gateway, Postgres, the reconciler and
the sleep and wake workflows on Temporal, a real node worker and a sim engine that sleeps as vLLM does and
says what memory it holds.

An idle replica goes to sleep (the same engine process, its accelerator memory released), a request wakes
it (the same process answers, its memory taken back), and a stop while it sleeps stops it, fenced like any
stop. The planner's rules are unit tests (tests/test_sleep_planner.py)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import psutil
import pytest

from tests.helpers import wait_until
from tests.test_gateway_on_demand import apply, body, replicas

pytestmark = pytest.mark.integration

MODEL = "sleepy"
MB = 1 << 20


def catalog(**scaling) -> dict:
    sc = {"min": 0, "max": 1, "sleep_after": 2, "idle_timeout": 60, **scaling}
    return {"models": [{"name": MODEL, "scaling": sc, "profiles": [{"engine": "sim", "args": [
        "--tokens-per-second", "0", "--gpu-memory-mb", "512", "--sleep-s", "0.2", "--wake-s", "0.3"]}]}]}


def engine_state(cp, rid: str) -> dict:
    """The engine's own word on its sleep and memory (`/is_sleeping`, with its key, as the node asks)."""
    import httpx

    spec = json.loads((cp.state / "shards" / "node-a" / f"{rid}-r0.json").read_text())
    r = httpx.get(spec["endpoint"] + "/is_sleeping", headers={"Authorization": f"Bearer {spec['api_key']}"}, timeout=5)
    r.raise_for_status()
    return {**r.json(), "pid": spec["pid"]}


async def test_an_idle_replica_sleeps_and_a_request_wakes_the_same_engine_and_a_stop_while_asleep_stops_it(
        control_plane):
    cp = control_plane
    cp.env.update({"LLMGW_LOAD_WAIT_S": "30", "LLMGW_REPLICA_DRAIN_TIMEOUT_S": "5", "LLMGW_RECONCILE_INTERVAL_S": "1"})
    await asyncio.to_thread(cp.start)
    cp.agent("node-a")
    await asyncio.to_thread(cp.wait_nodes, "node-a")
    await apply(cp, catalog())
    async with aiohttp.ClientSession() as s:
        async with s.post(cp.gateway + "/v1/chat/completions", json=body(MODEL)) as r:  # a cold start
            assert r.status == 200, await r.text()
        [rep] = await replicas(cp, MODEL)
        rid = rep["id"]
        awake = await asyncio.to_thread(engine_state, cp, rid)
        assert awake["is_sleeping"] is False and awake["accelerator_memory_bytes"] == 512 * MB

        # Idle for sleep_after: it goes to sleep, the same process, its accelerator memory released.
        await asyncio.to_thread(cp.wait_replicas, MODEL, "sleeping", 1, 20)
        asleep = await asyncio.to_thread(wait_until, lambda: (st := engine_state(cp, rid))["is_sleeping"] and st,
                                         10, 0.2, "the engine asleep")
        assert asleep["pid"] == awake["pid"] and psutil.pid_exists(asleep["pid"])
        assert asleep["accelerator_memory_bytes"] == 0 and asleep["offloaded_memory_bytes"] == 512 * MB
        shown = await asyncio.to_thread(cp.ctl, "replicas")
        assert rid[:8] in shown.stdout and "sleeping" in shown.stdout, shown.stdout + shown.stderr
        shown = await asyncio.to_thread(cp.ctl, "models", "-o", "json")
        [m] = [m for m in json.loads(shown.stdout) if m["name"] == MODEL]
        assert m["status"] == "sleeping" and "a request wakes one" in m["reason"], m
        explained = cp.explain(MODEL)
        assert "put replica" in json.dumps(explained) or "asleep" in json.dumps(explained), explained

        # A request wakes it: held meanwhile, answered by the same process, its memory taken back.
        t0 = time.monotonic()
        async with s.post(cp.gateway + "/v1/chat/completions", json=body(MODEL)) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]
        woke_s = time.monotonic() - t0
        [again] = [r for r in await replicas(cp, MODEL) if r["status"] not in ("stopped", "failed", "lost")]
        assert again["id"] == rid and again["status"] == "ready"
        back = await asyncio.to_thread(engine_state, cp, rid)
        assert back["pid"] == awake["pid"] and back["is_sleeping"] is False
        assert back["accelerator_memory_bytes"] == 512 * MB and back["offloaded_memory_bytes"] == 0
        assert woke_s < 10, f"a wake took {woke_s:.1f}s\n" + cp.logs()
        print(f"request -> answer through a wake: {woke_s * 1000:.0f} ms (sim wake 300 ms)")
        # Started by `decide` once its pass committed, not as the reconciler's child (one workflow task less
        # between the request and the wake), and once: the reconciler did not start it again.
        from temporalio.client import Client

        client = await Client.connect(cp.env["LLMGW_TEMPORAL_ADDRESS"],
                                      namespace=cp.env.get("LLMGW_TEMPORAL_NAMESPACE", "default"))
        runs = [w async for w in client.list_workflows(f'WorkflowId = "replica/{rid}/wake"')]
        assert len(runs) == 1 and runs[0].parent_id is None, [(w.run_id, w.parent_id) for w in runs]

    # Asleep again, then switched off: the stop stops the sleeping engine, fenced like any stop.
    await asyncio.to_thread(cp.wait_replicas, MODEL, "sleeping", 1, 20)
    await apply(cp, catalog(max=0))
    await asyncio.to_thread(cp.wait_replicas, MODEL, "stopped", 1, 20)
    wait_until(lambda: not psutil.pid_exists(awake["pid"]) or psutil.Process(awake["pid"]).status() == "zombie",
               10, 0.2, "the sleeping engine stopped")
    fence = cp.state / "shards" / "node-a" / "fences" / rid
    assert fence.exists() and int(fence.read_text()) >= 1, "the stop did not fence the replica on its node"
    agent_log = next(p for p in cp.procs if p.name == "agent-node-a").log()
    assert agent_log.count("launched shard") == 1, agent_log[-3000:]  # one engine throughout
    assert "asleep (level 1)" in agent_log and "awake in" in agent_log, agent_log[-3000:]
