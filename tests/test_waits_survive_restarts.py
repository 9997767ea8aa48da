"""Waits on a node that outlast their agent (workflows/options.py `ready`, `drain`): agent restarts while an
engine loads or drains end the wait's attempt, and the retry resumes the wait. Through real processes
(server, worker, agents SIGKILLed and started again, sim engines); asserted by the engine's pid.

Before: `wait_shard_ready` had 2 attempts, so a second agent restart during a load failed the healthy
loading replica, stopped its engine and placed another; `drain_shard` had 1 attempt and no resume, so an
agent restart cut a drain short 30 s later (the heartbeat timeout,
`LLMGW_NODE_WAIT_HEARTBEAT_TIMEOUT_S`) and the stop killed the engine with a
client's stream still in flight."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import psutil
import pytest

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.workflows.ids import replica_stop_id
from tests.helpers import ControlPlane, wait_until

pytestmark = pytest.mark.integration


def engine_pid(cp: ControlPlane, node: str, rid: str) -> int | None:
    p = cp.state / "shards" / node / f"{rid}-r0.json"
    return json.loads(p.read_text())["pid"] if p.exists() else None


def running(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_three_agent_restarts_while_an_engine_loads_rebuild_nothing(control_plane):
    load_s = 30
    cp = control_plane.start()
    agent = cp.agent("n1", stop_engines_on_exit=False)
    assert cp.apply({"models": [{"name": "slow", "scaling": {"min": 1, "max": 1}, "profiles": [
        {"engine": "sim", "args": ["--startup-delay", str(load_s)]}]}]}).status_code == 200
    [rep] = cp.wait_replicas("slow", status="starting", timeout_s=60)
    rid = rep["id"]
    pid = wait_until(lambda: engine_pid(cp, "n1", rid), timeout_s=60, what="the engine launched")
    time.sleep(2)  # the start waits on its readiness now
    for i in range(3):
        agent.kill()
        assert running(pid), "the engine outlives its agent"
        agent = cp.agent("n1", name=f"agent-n1-{i}", stop_engines_on_exit=False)
        wait_until(lambda: "registered" in agent.log(), timeout_s=60, what="the agent back")
        time.sleep(3)
        assert [(r["id"], r["status"]) for r in cp.replicas() if r["model"] == "slow"] == [(rid, "starting")], \
            cp.replicas()
    [ready] = cp.wait_replicas("slow", timeout_s=load_s + 60)
    assert ready["id"] == rid and engine_pid(cp, "n1", rid) == pid and running(pid)
    assert [r["id"] for r in cp.replicas() if r["model"] == "slow"] == [rid]  # nothing failed, nothing rebuilt
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_an_agent_restart_during_a_drain_lets_the_stream_in_flight_finish(tmp_path, database_url, temporal, namespace):
    # At 1 token/s: in flight for about 30 s, well past the drain's heartbeat timeout (6 s here, 30 s by default)
    # after which the dead agent's attempt is given to the restarted agent: that cut it before.
    tokens = 30
    cp = ControlPlane(tmp_path, database_url, temporal.address, LLMGW_TEMPORAL_NAMESPACE=namespace,
                      LLMGW_REPLICA_DRAIN_TIMEOUT_S="150", LLMGW_NODE_WAIT_HEARTBEAT_TIMEOUT_S="6")
    try:
        cp.start()
        agent = cp.agent("n1", stop_engines_on_exit=False)
        assert cp.apply({"models": [{"name": "drainy", "scaling": {"min": 1, "max": 1},
                                     "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "1"]}]}]}).status_code == 200
        [rep] = cp.wait_replicas("drainy", timeout_s=60)
        pid = engine_pid(cp, "n1", rep["id"])
        out: dict = {"lines": []}

        def stream():
            try:
                with httpx.stream("POST", cp.gateway + "/v1/chat/completions", timeout=300, json={
                        "model": "drainy", "stream": True, "max_tokens": tokens,
                        "messages": [{"role": "user", "content": "x"}]}) as r:
                    out["status"] = r.status_code
                    out["lines"] = [line for line in r.iter_lines() if line.strip()]
            except Exception as exc:  # noqa: BLE001 - the assertion below says what happened
                out["error"] = repr(exc)
        t = threading.Thread(target=stream)
        t.start()
        time.sleep(3)
        assert cp.apply({"models": []}).status_code == 200  # it leaves the catalog: drain, then stop
        wait_until(lambda: any(r["id"] == rep["id"] and r["status"] == "draining" for r in cp.replicas()),
                   timeout_s=30, what="draining")
        time.sleep(3)
        agent.kill()
        agent = cp.agent("n1", name="agent-n1-2", stop_engines_on_exit=False)
        t.join(120)
        assert not t.is_alive()
        text = "\n".join(out["lines"])
        assert out.get("status") == 200 and "error" not in out, out
        assert '"finish_reason":"length"' in text.replace(" ", "") and out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
        assert '"error"' not in text
        wait_until(lambda: not running(pid), timeout_s=60, what="the engine stopped once drained")
        # The drain waited under the setting, and its retry (the restarted agent's) is what finished it.
        drains = asyncio.run(drain_events(cp, namespace, replica_stop_id(rep["id"])))
        assert [a.heartbeat_timeout.ToSeconds() for a in drains["scheduled"]] == [6], drains
        assert drains["attempts"] and drains["attempts"][-1] >= 2, drains
    finally:
        cp.stop()


async def drain_events(cp: ControlPlane, namespace: str, workflow_id: str) -> dict:
    """The `drain_shard` activities of a stop workflow: as scheduled, and the attempt each started with."""
    client = await Client.connect(cp.env["LLMGW_TEMPORAL_ADDRESS"], namespace=namespace,
                                  data_converter=pydantic_data_converter)
    out: dict = {"scheduled": [], "attempts": [], "runs": []}
    # Every run under the id, oldest first: a later run (a stop asked again once the replica had ended) must
    # not hide the one that drained.
    runs = sorted([wf async for wf in client.list_workflows(f'WorkflowId = "{workflow_id}"')], key=lambda wf: wf.start_time)
    out["runs"] = [f"{wf.run_id[-8:]} {wf.status.name if wf.status else '?'}" for wf in runs]
    for run_id in [wf.run_id for wf in runs] or [None]:  # (none listed yet: the latest run, as before)
        drain_ids = set()
        async for e in client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events():
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and \
                    e.activity_task_scheduled_event_attributes.activity_type.name == "drain_shard":
                out["scheduled"].append(e.activity_task_scheduled_event_attributes)
                drain_ids.add(e.event_id)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and \
                    e.activity_task_started_event_attributes.scheduled_event_id in drain_ids:
                out["attempts"].append(e.activity_task_started_event_attributes.attempt)
    return out
