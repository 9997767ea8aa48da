"""`MirrorWorkflow` on its own: a worker with stand-in activities of the same names (STYLE.md), on the
test's own namespace. The real activities and processes are in test_mirror_workflow.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from llmgw.schemas.mirror import (
    DiscardInput, DiscardResult, ExploreInput, FetchMirrorFileInput, FileProgress, MirroredFile, MirrorInput,
    MirrorPlan, MirrorProgress, PlannedFile, PublishInput, PublishResult,
)
from llmgw.temporal import workflow_runner
from llmgw.workflows.mirror import MirrorWorkflow
from llmgw.workflows.queues import MIRROR_QUEUE
from llmgw.workflows.ids import mirror_workflow_id
from tests.helpers import await_until

pytestmark = pytest.mark.integration
SHA = "ab" * 32


class Stand:
    """Stand-in mirror activities that record what was asked of them."""

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.calls: list[str] = []
        self.release = asyncio.Event()

    def all(self) -> list:
        @activity.defn(name="explore_mirror_sources")
        async def explore(inp: ExploreInput) -> MirrorPlan:
            return MirrorPlan(name=inp.name, version=inp.version, kind="version", files=[
                PlannedFile(name="a.safetensors", url="http://o/a", size=10),
                PlannedFile(name="b.safetensors", url="http://o/b", size=None)])

        @activity.defn(name="fetch_mirror_file")
        async def fetch(inp: FetchMirrorFileInput) -> MirroredFile:
            if inp.file.name == self.fail:
                raise ApplicationError("the origin said no", non_retryable=True)
            info = activity.info()
            handle = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
            await handle.signal("file_progress", FileProgress(file=inp.file.name, bytes=5, total=inp.file.size))
            try:
                while not self.release.is_set():
                    activity.heartbeat()
                    await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                self.calls.append(f"{inp.file.name} stopped")
                raise
            return MirroredFile(name=inp.file.name, size=10, sha256=SHA)

        @activity.defn(name="publish_mirror_version")
        async def publish(inp: PublishInput) -> PublishResult:
            self.calls.append("publish")
            return PublishResult(source=f"mirror:{inp.name}/", files=len(inp.files), bytes=20)

        @activity.defn(name="discard_mirror_version")
        async def discard(inp: DiscardInput) -> DiscardResult:
            self.calls.append("discard")
            return DiscardResult(removed=True)

        return [explore, fetch, publish, discard]


async def run(temporal, namespace: str, stand: Stand):
    client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
    worker = Worker(client, task_queue=MIRROR_QUEUE, workflows=[MirrorWorkflow], activities=stand.all(),
                    workflow_runner=workflow_runner(sandbox_own_modules=True), max_heartbeat_throttle_interval=timedelta(seconds=0.5),
                    default_heartbeat_throttle_interval=timedelta(seconds=0.5))
    handle = await client.start_workflow(
        MirrorWorkflow.run, MirrorInput(name="m", version="v1", sources=["http://o/?token=SECRET"],
                                        heartbeat_timeout_s=5),
        id=mirror_workflow_id("m", "v1"), task_queue=MIRROR_QUEUE)
    return worker, handle


async def test_progress_is_the_sum_of_the_files_and_so_far_while_a_length_is_unknown(temporal, namespace):
    stand = Stand()
    worker, handle = await run(temporal, namespace, stand)
    async with worker:
        async def halfway():
            p = await handle.query(MirrorWorkflow.progress)
            return p if p and p.bytes == 10 else None

        p: MirrorProgress = await await_until(halfway, timeout_s=30, what="both files' progress")
        assert p.state == "downloading" and p.total is None and "so far" in p.line()
        assert p.sources == ["http://o/?<redacted>"]
        stand.release.set()
        result = await handle.result()
    assert result.source == "mirror:m/" and stand.calls == ["publish"]
    memo = await (await handle.describe()).memo_value("progress")
    assert memo["state"] == "published" and memo["total"] == 20 and "SECRET" not in str(memo)


async def test_a_failed_file_stops_the_others_then_discards_the_staging(temporal, namespace):
    stand = Stand(fail="a.safetensors")
    worker, handle = await run(temporal, namespace, stand)
    async with worker:
        with pytest.raises(WorkflowFailureError) as exc:
            await handle.result()
    assert "the origin said no" in str(exc.value.cause)
    assert stand.calls == ["b.safetensors stopped", "discard"]  # stopped first, then removed; never published
    memo = await (await handle.describe()).memo_value("progress")
    assert memo["state"] == "failed" and "the origin said no" in memo["reason"]
