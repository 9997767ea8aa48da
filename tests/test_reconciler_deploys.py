"""The reconciler survives deploys, through the real path (real control worker, Temporal, Postgres, agents).

- A control worker restarted with a changed planner (`tests/planner_hooks.py`) carries on with the same
  reconciler run: no workflow task fails, although the new planner decides differently from the one that
  recorded the run's earlier passes (they replay from recorded `decide` results). The new worker's settings
  (interval, ready timeout) take effect at once: they are read each pass, not frozen at first start.
- A planner that raises is the `decide` activity failing: `llmgw ctl explain` says so, and the reconciler
  carries on once a pass succeeds again.
- The singleton comes back when it is closed (terminated) or wedged (a workflow task that fails on every
  attempt, as after a deploy that broke replay): the control worker starts it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from llmgw.workflows.queues import CONTROL_QUEUE
from llmgw.workflows.ids import RECONCILER_ID
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def one_gpu(name: str) -> dict:
    return {"name": name, "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}


def run_async(coro):
    return asyncio.run(coro)


async def _client(temporal, namespace) -> Client:
    return await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)


async def _reconciler_runs(temporal, namespace) -> list[tuple[str, WorkflowExecutionStatus, list]]:
    """(run id, status, events) of every run of the reconciler, oldest first."""
    client = await _client(temporal, namespace)
    out = []
    async for wf in client.list_workflows(f"WorkflowId = '{RECONCILER_ID}'"):
        h = await client.get_workflow_handle(RECONCILER_ID, run_id=wf.run_id).fetch_history()
        out.append((wf.run_id, wf.status, h.events))
    return sorted(out, key=lambda r: r[2][0].event_time.ToDatetime())


def failed_tasks(events) -> list:
    return [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]


def test_a_planner_change_reaches_an_in_flight_reconciler(control_plane, temporal, namespace, tmp_path):
    cp = control_plane.start()
    for n in ("node-a", "node-b"):
        cp.agent(n, simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a", "node-b")
    assert cp.apply({"models": [one_gpu("a")]}).status_code == 200
    [a] = cp.wait_replicas("a", timeout_s=60)
    assert a["node_id"] == "node-a"
    [(run_id, _, _)] = run_async(_reconciler_runs(temporal, namespace))

    # Deploy: the control worker restarts with a planner that decides differently (it holds model a back:
    # replayed under it, the pass that placed a would now decide nothing) and with new settings.
    next(p for p in cp.procs if p.name == "worker").stop()
    control = tmp_path / "planner.json"
    control.write_text(json.dumps({"hold": ["a"]}))
    cp.spawn("worker-2", "worker", env={
        "LLMGW_PLANNER_HOOK": "tests.planner_hooks:from_file", "LLMGW_TEST_PLANNER_FILE": str(control),
        "LLMGW_RECONCILE_INTERVAL_S": "1", "LLMGW_REPLICA_READY_TIMEOUT_S": "77"})
    assert cp.apply({"models": [one_gpu("a"), one_gpu("b")]}).status_code == 200
    [b] = cp.wait_replicas("b", timeout_s=60)
    assert b["node_id"] == "node-b"
    runs = run_async(_reconciler_runs(temporal, namespace))
    assert runs[0][0] == run_id and runs[0][1] == WorkflowExecutionStatus.RUNNING, runs  # the same run carried on
    assert not failed_tasks(runs[0][2]), "replaying the earlier passes under the new planner failed"

    # The new planner decides: a, once failed, is held back, and says why.
    os.killpg(cp.shard_pid("node-a", f"{a['id']}-r0"), signal.SIGKILL)
    cp.wait_replicas("a", "failed", timeout_s=20)
    wait_until(lambda: any("held by the test hook" in line for line in cp.explain("a")["decisions"]),
               timeout_s=20, what="a held by the changed planner")
    assert not [r for r in cp.replicas() if r["model"] == "a" and r["status"] in ("starting", "ready")]

    # A planner that raises: the pass fails as an activity, retried; explain says so.
    control.write_text(json.dumps({"fail": "injected planner fault"}))
    wait_until(lambda: "injected planner fault" in cp.ctl("explain", "b").stdout, timeout_s=30,
               what="the planner failure in ctl explain")
    out = cp.ctl("explain", "b").stdout
    assert "the reconciler's planner is failing" in out and "retrying with a newer snapshot" in out
    # Fixed: the next attempt succeeds, a is placed again, the failure is gone from explain.
    control.write_text("{}")
    cp.wait_replicas("a", timeout_s=60)
    wait_until(lambda: "planner is failing" not in cp.ctl("explain", "b").stdout, timeout_s=10,
               what="the failure cleared")

    runs = run_async(_reconciler_runs(temporal, namespace))
    assert runs[0][0] == run_id  # the same run carried on (or continued as new), never replaced
    assert all(status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)
               for _, status, _ in runs), runs
    assert not [e for _, _, events in runs for e in failed_tasks(events)], "a workflow task failed"
    # Settings read each pass: b's start was given the new worker's ready timeout, and the timers between
    # passes are the new interval.
    client_events = runs[-1][2]
    timers = [e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta() for e in client_events
              if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
    assert timers and timers[-1] == timedelta(seconds=1), timers

    async def start_input() -> dict:
        client = await _client(temporal, namespace)
        h = await client.get_workflow_handle(f"replica/{b['id']}/start").fetch_history()
        started = h.events[0].workflow_execution_started_event_attributes
        return json.loads(started.input.payloads[0].data)
    assert run_async(start_input())["ready_timeout_s"] == 77


# ---- the singleton comes back -----------------------------------------------------------------------

@activity.defn(name="read_snapshot_v0")
async def read_snapshot_v0() -> str:
    return "a snapshot"


@workflow.defn(name="ReconcilerWorkflow")
class ReconcilerV0:
    """A reconciler as some earlier, incompatible code ran it: today's code cannot replay its history."""

    @workflow.signal
    def wake(self, reason: str) -> None:
        pass

    @workflow.run
    async def run(self, inp: dict) -> None:
        await workflow.execute_activity("read_snapshot_v0", start_to_close_timeout=timedelta(seconds=10))
        await asyncio.sleep(3600)


def test_a_closed_or_wedged_reconciler_is_started_again(control_plane, temporal, namespace):
    cp = control_plane
    cp.env["LLMGW_RECONCILER_WATCH_S"] = "1"
    cp.start(worker=False)

    async def start_v0() -> str:
        client = await _client(temporal, namespace)
        async with Worker(client, task_queue=CONTROL_QUEUE, workflows=[ReconcilerV0], activities=[read_snapshot_v0],
                          workflow_runner=UnsandboxedWorkflowRunner()):
            handle = await client.start_workflow("ReconcilerWorkflow", {}, id=RECONCILER_ID, task_queue=CONTROL_QUEUE)
            for _ in range(100):
                events = (await handle.fetch_history()).events
                if any(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED for e in events):
                    return (await handle.describe()).run_id
                await asyncio.sleep(0.2)
        raise AssertionError("the v0 reconciler never got to its timer")
    v0_run = run_async(start_v0())

    # Today's worker cannot replay that run (non-determinism on every attempt): it is replaced.
    cp.spawn("worker", "worker")
    cp.agent("node-a", simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a")
    assert cp.apply({"models": [one_gpu("a")]}).status_code == 200  # the wake that makes it replay
    cp.wait_replicas("a", timeout_s=120)
    runs = run_async(_reconciler_runs(temporal, namespace))
    assert runs[0][0] == v0_run and runs[0][1] == WorkflowExecutionStatus.TERMINATED
    assert failed_tasks(runs[0][2]), "the v0 run should have failed to replay"
    assert runs[-1][1] == WorkflowExecutionStatus.RUNNING
    assert "replaced: its workflow task failed" in next(p for p in cp.procs if p.name == "worker").log()

    # Terminated by hand: started again within the watch interval, and it works.
    async def terminate() -> None:
        await (await _client(temporal, namespace)).get_workflow_handle(RECONCILER_ID).terminate("test")
    run_async(terminate())
    wait_until(lambda: run_async(_reconciler_runs(temporal, namespace))[-1][1] == WorkflowExecutionStatus.RUNNING
               and len(run_async(_reconciler_runs(temporal, namespace))) == len(runs) + 1,
               timeout_s=20, what="the reconciler started again")
    cp.agent("node-b", simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-b")
    assert cp.apply({"models": [one_gpu("a"), one_gpu("b")]}).status_code == 200
    cp.wait_replicas("b", timeout_s=60)
