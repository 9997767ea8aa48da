"""The operator's side of `MirrorWorkflow`: `llmgw mirror add URL...`, `mirror list`, `mirror cancel`.

`add` computes the workflow id from the sources (`explorer.default_name`, `explorer.version_of`) and starts
the workflow with the conflict policy that returns the running one, then follows it: a progress bar with
bytes, rate and ETA (bytes "so far" while a length is unknown), from the workflow's `progress` query.
Ctrl-C detaches: the download belongs to the mirror worker, not to this terminal. `list` reads every
version's state from Temporal (memo for closed runs, the query for running ones); `cancel` cancels, and
the workflow removes what it staged. Sources are only ever shown redacted.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from llmgw.config import Settings
from llmgw.schemas.mirror import MirrorInput, MirrorProgress, MirrorResult, MirrorState, human_bytes
from llmgw.mirror.explorer import ExploreError, default_name, version_of, web_page_hint
from llmgw.weights.naming import SourceError, check_mirror_name
from llmgw.weights.urls import URLRefused, check_url, redact
from llmgw.workflows.queues import MIRROR_QUEUE
from llmgw.workflows.ids import MIRROR_PREFIX, mirror_workflow_id

QUERY = 'WorkflowType = "MirrorWorkflow"'


def _say(text: str) -> None:
    print(text, flush=True)


def _err(text: str) -> None:
    print(f"error: {text}", file=sys.stderr, flush=True)


async def _client(settings: Settings) -> Client | None:
    from llmgw.temporal import connect

    try:
        return await connect(settings, attempts=5)
    except SystemExit as exc:
        _err(str(exc))
        return None


def plan_id(sources: list[str], name: str | None) -> tuple[str, str]:
    """(name, version) for these sources, checked without fetching anything. Raises `ValueError`."""
    for s in sources:
        check_url(s)
        hint = web_page_hint(s)
        if hint:
            raise ExploreError(hint)
    name = check_mirror_name(name) if name else default_name(sources)
    return name, version_of(sources)


async def add(settings: Settings, sources: list[str], name: str | None, detach: bool = False) -> int:
    """Start (or join) the mirror of `sources` and follow it. Returns the exit code."""
    try:
        name, version = plan_id(sources, name)
    except (ExploreError, SourceError, URLRefused) as exc:
        _err(str(exc))
        return 2
    client = await _client(settings)
    if client is None:
        return 1
    wid = mirror_workflow_id(name, version)
    inp = MirrorInput(name=name, version=version, sources=sources, parallel_files=settings.mirror_parallel_files,
                      heartbeat_timeout_s=settings.mirror_heartbeat_timeout_s,
                      progress_interval_s=settings.mirror_progress_interval_s)
    handle = await client.start_workflow(
        "MirrorWorkflow", inp, id=wid, task_queue=MIRROR_QUEUE, result_type=MirrorResult,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"mirror {name} from {', '.join(redact(s) for s in sources[:3])}"[:400])
    _say(f"mirroring {name} (version {version}) as workflow {wid}")
    if detach:
        _say(f"detached: `llmgw mirror list` shows it, `llmgw mirror cancel {name}` stops it")
        return 0
    return await follow(handle, name)


async def follow(handle: WorkflowHandle, name: str) -> int:
    """Show the workflow's progress until it ends (0 published, 1 failed or canceled) or Ctrl-C (0)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, \
        TransferSpeedColumn

    detached = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, detached.set)
    result = asyncio.create_task(handle.result())
    tty = sys.stdout.isatty()
    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
    last_state = None
    last_line = 0.0
    silent_since = time.monotonic()
    try:
        with Progress(*columns, disable=not tty, transient=False) as bar:
            task = bar.add_task(name, total=None, note="")
            while not result.done() and not detached.is_set():
                p = await _query(handle)
                if p is None:
                    if time.monotonic() - silent_since > 10:
                        bar.update(task, note="waiting for the mirror worker (is `llmgw mirror serve` running?)")
                else:
                    silent_since = time.monotonic()
                    if p.state != last_state and p.state not in MirrorState.ended():
                        last_state = p.state
                        last_line = time.monotonic()
                        line = p.line() if p.state != MirrorState.downloading else \
                            f"downloading {p.files} file(s)" + (f", {human_bytes(p.total)}" if p.total else "")
                        if tty:
                            bar.console.print(f"{name}: {line}")
                        else:
                            _say(f"{name}: {line}")
                    bar.update(task, completed=p.bytes, total=p.total,
                               note="so far" if p.total is None and p.state == MirrorState.downloading else "")
                    if not tty and p.state == MirrorState.downloading and time.monotonic() - last_line > 10:
                        last_line = time.monotonic()
                        _say(f"{name}: {p.line()}")
                await asyncio.wait([result, asyncio.ensure_future(detached.wait())], timeout=0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if detached.is_set() and not result.done():
        result.cancel()
        _say(f"detached: {handle.id} keeps running on the mirror worker; `llmgw mirror list` shows it, "
             f"`llmgw mirror cancel {name}` stops it")
        return 0
    try:
        res: MirrorResult = result.result()
    except WorkflowFailureError as exc:
        cause = exc.cause
        while getattr(cause, "cause", None) is not None and not getattr(cause, "message", None):
            cause = cause.cause
        msg = getattr(cause, "message", None) or str(cause or exc)
        if "Cancel" in type(cause).__name__:
            _say(f"{name}: canceled; nothing was published")
        else:
            _say(f"{name}: failed: {msg.removeprefix(f'mirror of {name} failed: ')}")
        return 1
    _say(f"{name}: published {res.files} file(s), {human_bytes(res.bytes)}; source: {res.source}")
    return 0


async def _query(handle: WorkflowHandle) -> MirrorProgress | None:
    try:
        return await asyncio.wait_for(handle.query("progress", result_type=MirrorProgress), 5)
    except Exception:  # noqa: BLE001 - no worker yet, or the workflow just closed: the caller keeps waiting
        return None


async def versions(client: Client, all_runs: bool = False) -> list[tuple[MirrorProgress, str]]:
    """(progress, Temporal status) of every mirrored version, newest first; the latest run per id
    unless `all_runs`."""
    seen: set[str] = set()
    out = []
    async for wf in client.list_workflows(QUERY):
        if not wf.id.startswith(MIRROR_PREFIX) or (wf.id in seen and not all_runs):
            continue
        seen.add(wf.id)
        raw = await wf.memo_value("progress", None)
        p = MirrorProgress.model_validate(raw) if raw else None
        if wf.status == WorkflowExecutionStatus.RUNNING:
            live = await _query(client.get_workflow_handle(wf.id, run_id=wf.run_id))
            p = live or p
        if p is None:
            name, _, version = wf.id[len(MIRROR_PREFIX):].rpartition("/")
            p = MirrorProgress(name=name, version=version)
        status = wf.status.name.lower() if wf.status else "unknown"
        if wf.status in (WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.TIMED_OUT) \
                and p.state not in MirrorState.ended():
            p.state, p.reason = MirrorState.failed, f"workflow {status}"
        out.append((p, status))
    return out


async def list_versions(settings: Settings, all_runs: bool = False) -> int:
    client = await _client(settings)
    if client is None:
        return 1
    rows = await versions(client, all_runs)
    if not rows:
        _say("no versions downloaded with `llmgw mirror add URL` yet (files placed from `pypi:` or a path are "
             f"copied in at once, not downloaded: {settings.resolved_mirror_url.rstrip('/')}/files lists them)")
        return 0
    width = max(len(p.name) for p, _ in rows)
    _say(f"{'NAME':{width}}  {'VERSION':12}  {'STATE':11}  DETAIL")
    for p, _status in rows:
        detail = p.line() if p.state in (MirrorState.downloading, MirrorState.published, MirrorState.failed) else ""
        if p.state == MirrorState.published:
            detail = f"source: {p.source}  ({p.files} files, {human_bytes(p.bytes)})"
        elif p.state == MirrorState.failed:
            detail = p.reason or ""
        elif p.state == MirrorState.downloading:
            detail = p.line().removeprefix("downloading ")
        _say(f"{p.name:{width}}  {p.version:12}  {p.state.value:11}  {detail}")
    return 0


async def cancel(settings: Settings, name: str, version: str | None = None) -> int:
    client = await _client(settings)
    if client is None:
        return 1
    prefix = mirror_workflow_id(name, version) if version else f"{MIRROR_PREFIX}{name}/"

    def wanted(wid: str) -> bool:
        return wid == prefix if version else wid.startswith(prefix) and "/" not in wid[len(prefix):]

    running = [wf async for wf in client.list_workflows(f'{QUERY} AND ExecutionStatus = "Running"') if wanted(wf.id)]
    if not running:
        _err(f"no running mirror of {name}{f' version {version}' if version else ''} (`llmgw mirror list` shows them)")
        return 1
    for wf in running:
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
        await handle.cancel()
        try:
            await asyncio.wait_for(handle.result(), 60)
        except WorkflowFailureError:
            pass  # canceled: the expected end
        except asyncio.TimeoutError:
            _say(f"{wf.id}: cancel requested; the mirror worker has not confirmed it yet")
            continue
        _say(f"{wf.id}: canceled; its staged files were removed")
    return 0
