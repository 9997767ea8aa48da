"""Rolling replacement through the real path (issue 13): a profile change under steady load replaces
every replica, one at a time with a surge replica first, with zero failed requests; the RolloutWorkflow
(`rollout/<model>`) shows it in Temporal; `ctl replicas` shows each replica's profile hash."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.schemas.catalog import Profile
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def catalog(tps: int) -> dict:
    return {"models": [{"name": "roll", "scaling": {"min": 2, "max": 2, "target_in_flight": 50},
                        "profiles": [{"engine": "sim", "args": ["--tokens-per-second", str(tps)]}]}]}


async def client_loop(gateway: str, stop: asyncio.Event, results: list) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        while not stop.is_set():
            try:
                r = await c.post(gateway + "/v1/chat/completions", json={
                    "model": "roll", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6})
                results.append(r.status_code if r.status_code == 200 else (r.status_code, r.text[:200]))
            except httpx.HTTPError as exc:
                results.append(("error", repr(exc)))


def test_a_profile_change_under_load_replaces_every_replica_with_zero_failed_requests(
        control_plane, temporal, namespace):
    cp = control_plane
    cp.env["LLMGW_REPLICA_DRAIN_TIMEOUT_S"] = "20"
    cp.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    assert cp.apply(catalog(40)).status_code == 200
    old = cp.wait_replicas("roll", count=2, timeout_s=60)
    new_hash = Profile.model_validate(catalog(30)["models"][0]["profiles"][0]).spec_hash()
    wait_until(lambda: all(r.get("profile_hash") for r in cp.replicas(all=False)), timeout_s=15,
               what="the nodes reported what the replicas run")

    results: list = []

    def replaced() -> bool:
        live = [r for r in cp.replicas(all=False) if r["model"] == "roll"]
        return (len(live) == 2 and all(r["status"] == "ready" and r["profile_hash"] == new_hash for r in live)
                and not {r["id"] for r in live} & {r["id"] for r in old})

    ready_counts: list[int] = []

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            live = await asyncio.to_thread(cp.replicas, False)
            ready_counts.append(sum(1 for r in live if r["model"] == "roll" and r["status"] == "ready"))
            await asyncio.sleep(0.2)

    async def run():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(client_loop(cp.gateway, stop, results)) for _ in range(10)]
        tasks.append(asyncio.create_task(watch(stop)))
        try:
            await asyncio.sleep(1)
            assert (await asyncio.to_thread(cp.apply, catalog(30))).status_code == 200
            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(replaced):
                assert time.monotonic() < deadline, f"not replaced: {cp.replicas()}\n{cp.explain('roll')}"
                await asyncio.sleep(0.5)
            await asyncio.sleep(1)
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert min(ready_counts) >= 2, ready_counts  # never fewer Ready than before: the surge comes first
    failed = [r for r in results if r != 200]
    assert not failed, failed[:5]
    assert len(results) > 50
    ended = {r["id"]: r for r in cp.replicas() if r["id"] in {o["id"] for o in old}}
    assert all(r["status"] == "stopped" and "rolling update" in (r["ended_reason"] or "") for r in ended.values()), ended
    # Never more than one surge replica: at most 3 replicas were ever placed at once is implied by 4 in all.
    assert len([r for r in cp.replicas() if r["model"] == "roll"]) == 4

    async def rollout_done():
        client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
        h = client.get_workflow_handle("rollout/roll")
        return await h.result()
    res = asyncio.run(rollout_done())
    assert sorted(res.retired if hasattr(res, "retired") else res["retired"]) == sorted(o["id"] for o in old)
    out = cp.ctl("replicas")
    assert f"default@{new_hash[:8]}" in out.stdout, out.stdout


def test_a_rollout_whose_new_replica_keeps_failing_is_said_while_the_old_one_serves(control_plane):
    """The walkthrough's stuck rollout: the old replica serves and `ctl models` said nothing (ready, an
    empty message). Now its message says the new replica's starts are failing, and why."""
    cp = control_plane
    cp.env["LLMGW_START_BACKOFF_BASE_S"] = "30"
    cp.start()
    cp.agent("n1")
    cp.wait_nodes("n1")
    one = {"name": "roll", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}
    assert cp.apply({"models": [one]}).status_code == 200
    [old] = cp.wait_replicas("roll", timeout_s=60)
    broken = {**one, "profiles": [{"engine": "llamacpp", "source": "/nonexistent/roll.gguf", "memory_gb": 0.1}]}
    assert cp.apply({"models": [broken]}).status_code == 200

    def said() -> str | None:
        line = next((ln for ln in cp.ctl("models").stdout.splitlines() if ln.startswith("roll ")), "")
        return line if "start(s) of another replica failed in a row" in line else None

    line = wait_until(said, timeout_s=60, what="the failing rollout in ctl models", why=cp.logs)
    assert " ready " in line and "serving; " in line and "roll.gguf" in line, line
    assert [r["id"] for r in cp.replicas(all=False) if r["model"] == "roll" and r["status"] == "ready"] == [old["id"]]
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "roll", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def _live(cp, model: str) -> list[dict]:
    return [r for r in cp.replicas(all=False) if r["model"] == model and r["status"] in ("starting", "ready")]


def test_a_new_profile_no_node_can_hold_leaves_the_old_replicas_serving(control_plane):
    """A profile changed to need 1000 GB on a 64 GB node. Before, each rollout step found no room for a
    surge and retired one more old replica "to place into its room", until both were stopped and the model
    answered 503 unplaceable. Now the old replicas keep serving and the rollout says why it waits."""
    cp = control_plane
    cp.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    m = {"name": "roll", "scaling": {"min": 2, "max": 2}, "profiles": [{"engine": "sim", "memory_gb": 1}]}
    assert cp.apply({"models": [m]}).status_code == 200
    cp.wait_replicas("roll", count=2, timeout_s=60)
    wait_until(lambda: all(r.get("profile_hash") for r in _live(cp, "roll")), timeout_s=15, what="their hashes")
    before = sorted(r["id"] for r in _live(cp, "roll"))
    assert cp.apply({"models": [{**m, "profiles": [{"engine": "sim", "memory_gb": 1000}]}]}).status_code == 200
    time.sleep(12)  # six rollout steps (one every 2 s): the two old replicas were gone within this before
    assert sorted(r["id"] for r in _live(cp, "roll") if r["status"] == "ready") == before
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "roll", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_rollout_under_traffic_surges_by_one_replica(control_plane):
    """min 2, max 5, one client sending requests one after another (load 1). The surge replica was the
    newest, the scale-down delay held the count for it, so that count became the want and the rollout
    surged again: it reached 6 live replicas and placed 5 new ones. Now it never has more than 3 live
    and ends with 2 of the new profile, with no failed request."""
    cp = control_plane
    cp.env["LLMGW_REPLICA_DRAIN_TIMEOUT_S"] = "2"
    cp.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    m = {"name": "roll", "scaling": {"min": 2, "max": 5, "scale_down_delay": "120s", "target_in_flight": 8},
         "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "40"]}]}
    assert cp.apply({"models": [m]}).status_code == 200
    cp.wait_replicas("roll", count=2, timeout_s=60)
    wait_until(lambda: all(r.get("profile_hash") for r in _live(cp, "roll")), timeout_s=15, what="their hashes")
    old = {r["id"] for r in _live(cp, "roll")}

    async def run() -> tuple[int, list]:
        stop, results = asyncio.Event(), []
        client = asyncio.create_task(client_loop(cp.gateway, stop, results))
        await asyncio.sleep(2)
        assert cp.apply({"models": [{**m, "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "30"]}]}]}
                        ).status_code == 200
        most, deadline = 0, time.monotonic() + 90
        while time.monotonic() < deadline:
            live = await asyncio.to_thread(_live, cp, "roll")
            most = max(most, len(live))
            if len(live) == 2 and not {r["id"] for r in live} & old and all(r["status"] == "ready" for r in live):
                break
            await asyncio.sleep(0.5)
        stop.set()
        await client
        return most, results

    most, results = asyncio.run(run())
    live = _live(cp, "roll")
    assert len(live) == 2 and not {r["id"] for r in live} & old, live
    assert most <= 3, f"a 2-replica model surged to {most} live replicas"
    assert len([r for r in cp.replicas() if r["model"] == "roll"]) == 4  # 2 old, 2 new: nothing built to throw away
    assert results and all(r == 200 for r in results), [r for r in results if r != 200][:5]
