"""Control activities that give the same answer when retried after their transaction committed.

Temporal retries an activity whose completion it did not receive: the worker died after the commit, the
network dropped the answer. A state change retried blindly answers differently the second time (a retried
`mark_replica(ready)` finds the replica already ready and says "not applied"; a retried
`record_replica_failure` counts the failure twice). So each such activity stores its result in the same
transaction as its effect, keyed by the workflow run and the activity's id (stable across attempts), and a
retry returns the stored result without acting again.

The test hook `crash_after_commit` (settings `test_crash_after_commit`, `test_crash_marker`) SIGKILLs the
control worker right after a chosen activity's commit, once: the honest way to lose a completion through
the real path (tests/faults/test_start_faults.py).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio import activity

from llmgw.db import idempotency_repo

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel | None)


def idempotency_key() -> str | None:
    """`<workflow run id>/<activity id>` inside an activity started by a workflow; None elsewhere."""
    if not activity.in_activity():
        return None
    info = activity.info()
    if not info.workflow_run_id:
        return None
    return f"{info.workflow_run_id}/{info.activity_id}"


class CrashHook:
    """Test hook: SIGKILL this process right after the commit of activity `name` (optionally only when
    its `detail`, such as the target status, matches `name:detail`), once per `marker` file."""

    def __init__(self, spec: str | None, marker: Path | None):
        self.name, _, self.detail = (spec or "").partition(":")
        self.marker = marker

    def __call__(self, name: str, detail: str = "") -> None:
        if not self.name or self.marker is None or name != self.name or (self.detail and detail != self.detail):
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{name}:{detail}\n".encode())
        os.close(fd)
        log.warning("test hook: killing the control worker after %s(%s) committed", name, detail)
        os.kill(os.getpid(), signal.SIGKILL)


async def once(engine: AsyncEngine, name: str, result_type: type[T] | None,
               body: Callable[[AsyncConnection], Awaitable[T]], crash: CrashHook | None = None,
               detail: str = "") -> T:
    """Run `body(conn)` in one transaction and store its result under this activity's idempotency key; a
    retry of the same activity finds the stored result and returns it without running `body` again.

    Two attempts racing (a timed-out attempt still running beside its retry) both run `body`, but only one
    commits: the other's insert of the key conflicts, its transaction rolls back, and its own retry then
    returns the winner's result."""
    async with engine.begin() as conn:
        found, result = await stored(conn, name, result_type)
        if found:
            return result
        result = await body(conn)
        await store(conn, name, result)
    if crash is not None:
        crash(name, detail)
    return result


def may_have_committed() -> bool:
    """Whether an earlier attempt of this activity may have committed: not on its first attempt, whose key
    no attempt has used yet (an operator's `temporal activity reset` restarts the count on the same key,
    and then `store`'s insert conflicts, the transaction rolls back, and the retry finds the result)."""
    return not activity.in_activity() or activity.info().attempt > 1


async def stored(conn: AsyncConnection, name: str, result_type: type[T] | None) -> tuple[bool, T | None]:
    """(True, the result) when this activity already committed under its idempotency key (this is a retry),
    else (False, None). A first attempt does not look (`may_have_committed`)."""
    key = idempotency_key()
    if key is None or not may_have_committed():
        return False, None
    found, value = await idempotency_repo.get_result(conn, key)
    if not found:
        return False, None
    log.info("%s retried after it committed (%s); returning its stored result", name, key)
    return True, _decode(result_type, value)


async def store(conn: AsyncConnection, name: str, result: BaseModel | None) -> None:
    """Store `result` under this activity's idempotency key, in the caller's transaction (with its effect)."""
    key = idempotency_key()
    if key is None:
        return
    value = result.model_dump(mode="json") if isinstance(result, BaseModel) else None
    await idempotency_repo.put_result(conn, key, name, value)


def _decode(result_type, stored):
    if result_type is None or stored is None:
        return None
    return result_type.model_validate(stored)
