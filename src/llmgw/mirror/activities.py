"""Mirror activities, run by the mirror worker (`llmgw mirror serve`) on `llmgw-mirror`, where the mirror's
directory is: explore the sources, fetch each file into the version's staging directory, publish it,
discard it.

`fetch_mirror_file` is idempotent and resumable: it holds the file's lock, finds a file an earlier
attempt completed (its sha256 recorded beside it), else resumes the partial its last heartbeat named
(`heartbeat_details`: partial file, bytes so far) or any an earlier attempt left, and heartbeats every
second. Progress goes three ways: the heartbeat (resume), a `file_progress` signal to its workflow every
`progress_interval_s` (the workflow's query and memo, so `llmgw mirror add/list` and the Temporal UI show
it) and the mirror's Prometheus gauges. Cancelled (the workflow was cancelled, or the worker stops), it
leaves the partial: a restarted worker resumes it, and a cancelled workflow discards the staging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmgw.failures import expected_failure
from llmgw.schemas.mirror import (
    DiscardInput, DiscardResult, ExploreInput, FetchMirrorFileInput, FileProgress, MirroredFile, MirrorPlan,
    PublishInput, PublishResult,
)
from llmgw.telemetry import MirrorMetrics
from llmgw.weights.download import FetchError, Limits, download, sha256_of, target_lock
from llmgw.mirror.explorer import ExploreError, Explorer
from llmgw.weights.manifest import record_sha256
from llmgw.weights.naming import not_a_gguf
from llmgw.mirror.staging import (
    PublishError, discard, open_staging, publish, published_as, published_version, staged_record, staging_dir,
)
from llmgw.weights.urls import AddressPolicy

log = logging.getLogger(__name__)


class MirrorActivities:
    """Bound to one mirror directory, its address policy and fetch limits."""

    def __init__(self, root: Path, policy: AddressPolicy, limits: Limits, metrics: MirrorMetrics | None = None):
        self.root = root
        self.policy = policy
        self.limits = limits
        self.metrics = metrics or MirrorMetrics()

    def all(self) -> list:
        return [self.explore_mirror_sources, self.fetch_mirror_file, self.publish_mirror_version,
                self.discard_mirror_version]

    @activity.defn(name="explore_mirror_sources")
    async def explore_mirror_sources(self, inp: ExploreInput) -> MirrorPlan:
        """The exact files the sources stand for (mirror/explorer.py); opens the staging directory, from
        when on the mirror answers the name with "not ready yet". A name already published as this version
        needs nothing more (`published`); one published otherwise is refused before anything is fetched."""
        try:
            plan = await Explorer(self.policy, self.limits).plan(inp)
        except ExploreError as exc:
            raise expected_failure(str(exc), "ExploreError", exc.retryable) from None
        exists, version = await asyncio.to_thread(published_version, self.root, inp.name)
        if exists and version == inp.version:
            return plan.model_copy(update={"published": True})
        if exists:
            raise ApplicationError(
                f"{inp.name} is already in the mirror{f' (version {version}, from other sources)' if version else ''}; "
                "a published name never changes (nodes cache weights by name): mirror this under another --name",
                type="PublishError", non_retryable=True)
        await asyncio.to_thread(open_staging, self.root, inp.name, inp.version, plan.kind)
        return plan

    @activity.defn(name="fetch_mirror_file")
    async def fetch_mirror_file(self, inp: FetchMirrorFileInput) -> MirroredFile:
        """Fetch one planned file into the staging directory, verified (see the module docstring)."""
        f = inp.file
        stage = staging_dir(self.root, inp.name, inp.version)
        stage.mkdir(parents=True, exist_ok=True)
        dest = stage / f.name
        details = activity.info().heartbeat_details
        hint = details[0].get("partial") if details and isinstance(details[0], dict) else None
        beat = _Beat(self.metrics, f"{inp.name}/{inp.version}", f.name, f.size, inp.progress_interval_s)
        task = asyncio.create_task(beat.run())
        try:
            async with target_lock(stage, dest):
                done = await asyncio.to_thread(_completed, stage, f.name, f.size)
                if done is not None:
                    beat.update(done[0], done[0])
                    return MirroredFile(name=f.name, size=done[0], sha256=done[1])
                if hint:
                    log.info("resuming %s of %s/%s from %s", f.name, inp.name, inp.version, hint)
                got = await download(f.url, dest, stage, expect_size=f.size, expect_sha=f.sha256,
                                     progress=beat.update, limits=self.limits, policy=self.policy,
                                     resume_hint=hint, on_partial=beat.set_partial)
                # Judged by the name it is published under: a single file's is the version's (`--name x.gguf`).
                wrong = await asyncio.to_thread(lambda: not_a_gguf(published_as(stage, f.name), dest))
                if wrong is not None:
                    await asyncio.to_thread(dest.unlink, True)
                    raise FetchError(wrong, retryable=False)
                await asyncio.to_thread(record_sha256, stage, {f.name: got.sha256})
                self.metrics.fetched.inc(got.received)
                return MirroredFile(name=f.name, size=got.size, sha256=got.sha256, resumed_from=got.resumed_from,
                                    received=got.received)
        except FetchError as exc:
            self.metrics.failures.labels("yes" if exc.retryable else "no").inc()
            raise expected_failure(str(exc), "FetchError", exc.retryable) from None
        finally:
            task.cancel()
            await beat.finish()

    @activity.defn(name="publish_mirror_version")
    async def publish_mirror_version(self, inp: PublishInput) -> PublishResult:
        """Publish the staged version whole (mirror/staging.py). Idempotent."""
        try:
            res = await asyncio.to_thread(publish, self.root, inp)
        except PublishError as exc:
            raise ApplicationError(str(exc), type="PublishError", non_retryable=True) from None
        if not res.already:
            self.metrics.published.inc()
        log.info("published %s (%d files, %d bytes)%s", res.source, res.files, res.bytes,
                 " (already published)" if res.already else "")
        return res

    @activity.defn(name="discard_mirror_version")
    async def discard_mirror_version(self, inp: DiscardInput) -> DiscardResult:
        """Remove a canceled or failed version's staging directory: nothing is left behind."""
        return DiscardResult(removed=await asyncio.to_thread(discard, self.root, inp.name, inp.version))


def _completed(stage: Path, name: str, size: int | None) -> tuple[int, str] | None:
    """(size, sha256) of a file an earlier attempt completed and verified, or None."""
    p = stage / name
    if not p.is_file() or (size is not None and p.stat().st_size != size):
        return None
    sha = staged_record(stage, name) or sha256_of(p).hexdigest()  # renamed, but its record not yet written
    return p.stat().st_size, sha


class _Beat:
    """One file's progress: heartbeats (resume point), signals to the workflow, the mirror's gauges."""

    def __init__(self, metrics: MirrorMetrics, version: str, file: str, total: int | None, every_s: float):
        self.metrics = metrics
        self.version = version
        self.file = file
        self.bytes = 0
        self.total = total
        self.partial: str | None = None
        self.every_s = every_s
        self._sent = -1.0
        self._sent_bytes = -1

    def update(self, n: int, total: int | None) -> None:
        self.bytes = n
        self.total = total if total is not None else self.total
        self.metrics.progress(self.version, self.file, n, self.total)

    def set_partial(self, name: str) -> None:
        """The partial this attempt writes: heartbeated at once, so a restarted worker resumes it."""
        self.partial = name
        activity.heartbeat(self.details())

    def details(self) -> dict:
        return {"partial": self.partial, "bytes": self.bytes, "total": self.total}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # after `set_partial`'s beat: the first one that reaches Temporal names it
            activity.heartbeat(self.details())
            if time.monotonic() - self._sent >= self.every_s and self.bytes != self._sent_bytes:
                await self._signal()

    async def finish(self) -> None:
        self.metrics.progress(self.version, self.file, None, None)

    async def _signal(self) -> None:
        self._sent = time.monotonic()
        self._sent_bytes = self.bytes
        info = activity.info()
        try:
            handle = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
            await handle.signal("file_progress", FileProgress(file=self.file, bytes=self.bytes, total=self.total))
        except Exception as exc:  # noqa: BLE001 - progress is a courtesy; the fetch goes on
            log.debug("progress signal for %s failed: %s", self.file, exc)
