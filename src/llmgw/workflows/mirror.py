"""`MirrorWorkflow`: mirror one version into the mirror, whole, durably. Id `mirror/<name>/<version>`
(`ids.mirror_workflow_id`), started with the conflict policy that returns the running one, so two
operators mirroring the same version make one download. Runs on the mirror worker's queue, where the
mirror's directory is (`llmgw mirror serve`).

1. `explore_mirror_sources`: the exact files (a safetensors layout, a split GGUF, files); from here the
   mirror answers the name with "not ready yet".
2. `fetch_mirror_file` per file, `parallel_files` at once, each resumable across worker restarts.
3. `publish_mirror_version`: the version appears whole, or not at all.

Failed or canceled: the other fetches are stopped, then the staging files are removed
(`discard_mirror_version`), and the reason stays in the workflow's result and memo.

Progress: the `progress` query (`MirrorProgress`), the memo (`progress`: on every state change and at
most every `MEMO_EVERY`, so history stays short), and the current details line the Temporal UI shows.
Sources are shown redacted: a signed URL's query string is a credential.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.mirror import (
        DiscardInput, ExploreInput, FetchMirrorFileInput, FileProgress, MirroredFile, MirrorInput, MirrorProgress,
        MirrorResult, MirrorState, PlannedFile, PublishInput,
    )
    from llmgw.weights.urls import redact
    from llmgw.workflows import activities, options
    from llmgw.workflows.queues import MIRROR_QUEUE
    from llmgw.workflows.replica import failure_text

MEMO_EVERY = timedelta(seconds=30)


@workflow.defn(name="MirrorWorkflow")
class MirrorWorkflow:
    def __init__(self) -> None:
        self._p: MirrorProgress | None = None
        self._bytes: dict[str, int] = {}
        self._sizes: dict[str, int | None] = {}
        self._done: set[str] = set()
        self._memo_at: datetime | None = None

    @workflow.query
    def progress(self) -> MirrorProgress | None:
        return self._p

    @workflow.signal
    def file_progress(self, p: FileProgress) -> None:
        """From a fetch activity: bytes so far of one file."""
        if self._p is None or p.file not in self._bytes or p.file in self._done:
            return
        self._bytes[p.file] = p.bytes
        if self._sizes.get(p.file) is None and p.total is not None:
            self._sizes[p.file] = p.total
        self._refresh(memo=self._memo_at is None or workflow.now() - self._memo_at >= MEMO_EVERY)

    @workflow.run
    async def run(self, inp: MirrorInput) -> MirrorResult:
        self._p = MirrorProgress(name=inp.name, version=inp.version, sources=[redact(s) for s in inp.sources])
        self._refresh(memo=True)
        tasks: list[asyncio.Task] = []
        try:
            plan = await workflow.execute_activity(
                activities.explore_mirror_sources,
                ExploreInput(name=inp.name, version=inp.version, sources=inp.sources),
                task_queue=MIRROR_QUEUE, **options.MIRROR_QUICK)
            self._bytes = {f.name: 0 for f in plan.files}
            self._sizes = {f.name: f.size for f in plan.files}
            self._p.source = plan.source
            self._p.files = len(plan.files)
            if plan.published:  # mirrored before, from these sources: nothing to do
                self._done = set(self._bytes)
                self._bytes = {f.name: f.size or 0 for f in plan.files}
                self._p.state = MirrorState.published
                self._refresh(memo=True)
                return MirrorResult(name=inp.name, version=inp.version, source=plan.source, files=len(plan.files),
                                    bytes=self._p.bytes)
            self._p.state = MirrorState.downloading
            self._refresh(memo=True)
            gate = asyncio.Semaphore(inp.parallel_files)
            tasks = [asyncio.create_task(self._fetch(inp, f, gate)) for f in plan.files]
            files: list[MirroredFile] = await asyncio.gather(*tasks)
            self._p.state = MirrorState.publishing
            self._refresh(memo=True)
            res = await workflow.execute_activity(
                activities.publish_mirror_version,
                PublishInput(name=inp.name, version=inp.version, kind=plan.kind, files=files),
                task_queue=MIRROR_QUEUE, **options.MIRROR_PUBLISH)
        except (ActivityError, asyncio.CancelledError) as exc:
            if is_cancelled_exception(exc):  # the workflow was canceled (a fetch may surface it first)
                await asyncio.shield(self._end(inp, tasks, MirrorState.canceled, None))
                raise
            reason = failure_text(exc)
            await asyncio.shield(self._end(inp, tasks, MirrorState.failed, reason))
            raise ApplicationError(f"mirror of {inp.name} failed: {reason}", type="MirrorFailed",
                                   non_retryable=True) from None
        self._p.state = MirrorState.published
        self._p.source = res.source
        self._refresh(memo=True)
        return MirrorResult(name=inp.name, version=inp.version, source=res.source, files=res.files, bytes=res.bytes)

    async def _fetch(self, inp: MirrorInput, f: PlannedFile, gate: asyncio.Semaphore) -> MirroredFile:
        async with gate:
            got = await workflow.execute_activity(
                activities.fetch_mirror_file,
                FetchMirrorFileInput(name=inp.name, version=inp.version, file=f,
                                     progress_interval_s=inp.progress_interval_s),
                task_queue=MIRROR_QUEUE, **options.mirror_fetch(inp.heartbeat_timeout_s))
        self._done.add(f.name)
        self._bytes[f.name] = got.size
        self._sizes[f.name] = got.size
        self._refresh(memo=False)
        return got

    async def _end(self, inp: MirrorInput, tasks: list[asyncio.Task], state: MirrorState, reason: str | None) -> None:
        """Stop every fetch still running, wait for them, then remove the staging files."""
        assert self._p is not None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._p.state = state
        self._p.reason = reason
        await workflow.execute_activity(
            activities.discard_mirror_version, DiscardInput(name=inp.name, version=inp.version),
            task_queue=MIRROR_QUEUE, **options.MIRROR_QUICK)
        self._refresh(memo=True)

    def _refresh(self, memo: bool) -> None:
        p = self._p
        assert p is not None
        if self._bytes:
            p.bytes = sum(self._bytes.values())
            sizes = list(self._sizes.values())
            p.total = None if None in sizes else sum(s for s in sizes if s is not None)
            p.files_done = len(self._done)
        workflow.set_current_details(f"{p.name} ({p.version}): {p.line()}")
        if memo:
            self._memo_at = workflow.now()
            workflow.upsert_memo({"progress": p.model_dump(mode="json")})
