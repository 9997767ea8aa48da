"""`ReconcilerWorkflow` on its own: the real workflow on a worker in this process, with stand-in activities
of the same names (samples-python's pattern), against a Temporal dev server of its own that suggests
continue-as-new after a few dozen events.

- Continue-as-new is checked after every pass, back-to-back passes included.
- A run records the retired `decide-in-activity` patch as deprecated, for workers one release back.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from llmgw.dev.procs import free_port
from llmgw.dev.temporal_server import TemporalDevServer
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import (
    DecideInput, DecideResult, PassAction, ReconcilerInput, RecordDecisionsInput, ShardPlacement,
    Snapshot,
)
from llmgw.control.worker import workflow_runner
from llmgw.workflows.queues import CONTROL_QUEUE
from llmgw.workflows.reconciler import MAX_PASSES, ReconcilerWorkflow
from tests.stand_workflows import FailingStart

pytestmark = pytest.mark.integration

SUGGEST_AFTER_EVENTS = 60  # above two legacy passes (about 35 events), far below MAX_PASSES passes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("temporal-can")
    s = TemporalDevServer(free_port(), None, None, root / "temporal.log", namespaces=["can"],
                          dynamic_config={"limit.historyCount.suggestContinueAsNew": str(SUGGEST_AFTER_EVENTS)})
    s.start()
    try:
        yield s
    finally:
        s.stop()


class Stand:
    """Stand-ins for the control activities: `decide` always has more to do (back-to-back passes)."""

    def __init__(self, more: bool):
        self.more = more
        self.decides = 0
        self.snapshots = 0

    @activity.defn(name="decide")
    async def decide(self, inp: DecideInput) -> DecideResult:
        self.decides += 1
        return DecideResult(more=self.more, interval_s=0.2)

    @activity.defn(name="read_snapshot")
    async def read_snapshot(self) -> Snapshot:
        self.snapshots += 1
        return Snapshot(now=datetime.now(timezone.utc))

    @activity.defn(name="record_decisions")
    async def record_decisions(self, inp: RecordDecisionsInput) -> None:
        pass

    def all(self) -> list:
        return [self.decide, self.read_snapshot, self.record_decisions]


def worker(client: Client, stand: Stand, **kw) -> Worker:
    return Worker(client, task_queue=CONTROL_QUEUE, workflows=[ReconcilerWorkflow], activities=stand.all(),
                  workflow_runner=workflow_runner(sandbox_own_modules=True), **kw)


async def events(client: Client, wf_id: str, run_id: str) -> list:
    return (await client.get_workflow_handle(wf_id, run_id=run_id).fetch_history()).events


def scheduled(evs) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in evs
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_back_to_back_passes_continue_as_new_when_temporal_suggests(server):
    client = await Client.connect(server.address, namespace="can", data_converter=pydantic_data_converter)
    stand = Stand(more=True)
    wf_id = f"reconciler-{uuid.uuid4().hex[:8]}"
    async with worker(client, stand):
        handle = await client.start_workflow(ReconcilerWorkflow.run, ReconcilerInput(), id=wf_id,
                                             task_queue=CONTROL_QUEUE)
        first = (await handle.describe()).run_id
        for _ in range(100):
            if (await client.get_workflow_handle(wf_id, run_id=first).describe()).status \
                    == WorkflowExecutionStatus.CONTINUED_AS_NEW:
                break
            await asyncio.sleep(0.1)
        evs = await events(client, wf_id, first)
        await client.get_workflow_handle(wf_id).terminate("test done")  # its next run would keep deciding
    assert evs[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    passes = scheduled(evs).count("decide")
    # Every pass asked for another at once, yet the run continued as new as soon as Temporal suggested it.
    assert 1 <= passes < MAX_PASSES // 4, passes
    assert len(evs) <= SUGGEST_AFTER_EVENTS + 10
    nxt = evs[-1].workflow_execution_continued_as_new_event_attributes
    assert f'"passes":{passes}' in nxt.input.payloads[0].data.decode()


async def test_a_new_run_still_records_the_retired_patch_for_workers_one_release_back(server):
    """The reconciler's patches are deprecated (issue 38: `_legacy_pass` and the `record_placements` branch
    removed): a run of this code still records their markers at its first pass (`deprecate_patch`), flagged
    deprecated, so a control worker one release back, which asks `patched(...)` there, replays it on the
    branch this code takes during a rolling deploy."""
    client = await Client.connect(server.address, namespace="can", data_converter=pydantic_data_converter)
    wf_id = f"reconciler-{uuid.uuid4().hex[:8]}"
    stand = Stand(more=False)
    async with worker(client, stand):
        handle = await client.start_workflow(ReconcilerWorkflow.run, ReconcilerInput(), id=wf_id,
                                             task_queue=CONTROL_QUEUE)
        run = (await handle.describe()).run_id
        for _ in range(100):
            if stand.decides:
                break
            await asyncio.sleep(0.1)
        evs = await events(client, wf_id, run)
        await handle.terminate("test done")
    assert stand.decides == 1 and stand.snapshots == 0 and scheduled(evs) == ["decide"]
    markers = [e.marker_recorded_event_attributes for e in evs if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    patches = {(d := json.loads(m.details["patch-data"].payloads[0].data))["id"]: d["deprecated"] for m in markers}
    assert patches == {"decide-in-activity/0": True, "issue13-decide-places/0": True,
                       "issue13-decide-starts/0": True}, patches


class Placing(Stand):
    """`decide` places one replica at the first pass and nothing after; the run then waits for its timer."""

    @activity.defn(name="decide")
    async def decide(self, inp: DecideInput) -> DecideResult:
        self.decides += 1
        actions = [PassAction(kind="place", model="m", line="place m", replica_id=str(uuid.uuid4()),
                              profile="default", profile_spec=Profile(engine="sim"),
                              shards=[ShardPlacement(node_id="n1", rank=0)])] if self.decides == 1 else []
        return DecideResult(actions=actions, more=False, interval_s=60)


async def test_a_failed_child_start_is_collected_not_logged_as_never_retrieved(server, caplog):
    """The reconciler abandons its children and never awaits them; their failures are the children's to
    record. Uncollected, each failed start became an ERROR traceback in the worker's log ("_ChildWorkflowHandle
    exception was never retrieved") once the handle was garbage-collected (seen in `llmgw dev`)."""
    client = await Client.connect(server.address, namespace="can", data_converter=pydantic_data_converter)
    stand = Placing(more=False)
    caplog.set_level(logging.ERROR)
    async with Worker(client, task_queue=CONTROL_QUEUE, workflows=[ReconcilerWorkflow, FailingStart],
                      activities=stand.all(), workflow_runner=workflow_runner()):
        handle = await client.start_workflow(ReconcilerWorkflow.run, ReconcilerInput(),
                                             id=f"reconciler-{uuid.uuid4().hex[:8]}", task_queue=CONTROL_QUEUE)
        for _ in range(100):
            if any(e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_FAILED
                   for e in (await handle.fetch_history()).events):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the stand-in start never failed")
        await asyncio.sleep(0.5)  # the run's activation with the child's failure has been processed
        gc.collect()
    await handle.terminate("test done")
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], \
        [r.getMessage()[:300] for r in caplog.records]
