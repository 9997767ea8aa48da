"""Files and batches (issue 41): all SQL for `batch_files`, `batches` and `batch_results`.

Every read takes the owner (`tenant:<name>`, `key:<id>`, `-`): a file or batch of another owner is not
found, the same answer as one that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db import usage_repo
from llmgw.db.tables import batch_files, batch_results, batches
from llmgw.schemas.batches import BatchStatus


@dataclass(frozen=True)
class FileRow:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime


@dataclass(frozen=True)
class BatchRow:
    id: str
    owner: str
    key_id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    total: int
    metadata: dict | None
    errors: dict | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    failed_at: datetime | None
    completed: int = 0  # requests answered 2xx so far
    failed: int = 0  # requests answered otherwise


@dataclass(frozen=True)
class ResultRow:
    custom_id: str
    line: int
    status_code: int
    body: dict


_FILE_COLS = (batch_files.c.id, batch_files.c.owner, batch_files.c.filename, batch_files.c.purpose,
              batch_files.c.bytes, batch_files.c.created_at)


async def add_file(conn: AsyncConnection, file_id: str, owner: str, filename: str, purpose: str,
                   content: bytes) -> FileRow:
    """Store a file (a file of the same id already there is kept: a batch's output written again)."""
    stmt = pg_insert(batch_files).values(id=file_id, owner=owner, filename=filename, purpose=purpose,
                                         bytes=len(content), content=content)
    await conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))
    row = await get_file(conn, owner, file_id)
    assert row is not None
    return row


async def get_file(conn: AsyncConnection, owner: str, file_id: str) -> FileRow | None:
    r = (await conn.execute(select(*_FILE_COLS).where(batch_files.c.id == file_id,
                                                      batch_files.c.owner == owner))).first()
    return FileRow(*r) if r else None


async def file_content(conn: AsyncConnection, owner: str | None, file_id: str) -> bytes | None:
    """A file's bytes; `owner` None: whoever owns it (the batch's own activities)."""
    where = [batch_files.c.id == file_id] + ([batch_files.c.owner == owner] if owner is not None else [])
    return (await conn.execute(select(batch_files.c.content).where(*where))).scalar_one_or_none()


async def list_files(conn: AsyncConnection, owner: str, purpose: str | None, after: str | None,
                     limit: int) -> list[FileRow]:
    """An owner's files, newest first; `after`: those listed after that id."""
    q = select(*_FILE_COLS).where(batch_files.c.owner == owner)
    if purpose:
        q = q.where(batch_files.c.purpose == purpose)
    if after:
        mark = select(batch_files.c.created_at).where(batch_files.c.id == after,
                                                      batch_files.c.owner == owner).scalar_subquery()
        q = q.where((batch_files.c.created_at, batch_files.c.id) < (mark, after))
    q = q.order_by(batch_files.c.created_at.desc(), batch_files.c.id.desc()).limit(limit)
    return [FileRow(*r) for r in (await conn.execute(q)).all()]


async def delete_file(conn: AsyncConnection, owner: str, file_id: str) -> bool:
    r = await conn.execute(delete(batch_files).where(batch_files.c.id == file_id, batch_files.c.owner == owner))
    return r.rowcount > 0


# ---- batches ----------------------------------------------------------------------------------------

_COUNTS = (select(batch_results.c.batch_id,
                  func.count().filter(batch_results.c.status_code.between(200, 299)).label("completed"),
                  func.count().filter(~batch_results.c.status_code.between(200, 299)).label("failed"))
           .group_by(batch_results.c.batch_id).subquery())


def _batch_query():
    return (select(batches, func.coalesce(_COUNTS.c.completed, 0), func.coalesce(_COUNTS.c.failed, 0))
            .select_from(batches.outerjoin(_COUNTS, _COUNTS.c.batch_id == batches.c.id)))


def _batch(r) -> BatchRow:
    *cols, completed, failed = r
    cols[7] = BatchStatus(cols[7])
    return BatchRow(*cols, completed=completed, failed=failed)


async def add_batch(conn: AsyncConnection, batch_id: str, owner: str, key_id: str, tenant: str, endpoint: str,
                    input_file_id: str, window_s: int, window: str, total: int, metadata: dict | None) -> BatchRow:
    """A new batch, `in_progress` from now, expiring `window_s` after it was created (the database clock)."""
    await conn.execute(insert(batches).values(
        id=batch_id, owner=owner, key_id=key_id, tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
        completion_window=window, status=BatchStatus.IN_PROGRESS.value, total=total, metadata=metadata,
        expires_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, window_s), in_progress_at=func.now()))
    row = await get_batch(conn, owner, batch_id)
    assert row is not None
    return row


async def get_batch(conn: AsyncConnection, owner: str | None, batch_id: str) -> BatchRow | None:
    """A batch with its counts so far; `owner` None: whoever owns it."""
    q = _batch_query().where(batches.c.id == batch_id)
    if owner is not None:
        q = q.where(batches.c.owner == owner)
    r = (await conn.execute(q)).first()
    return _batch(r) if r else None


async def list_batches(conn: AsyncConnection, owner: str, after: str | None, limit: int) -> list[BatchRow]:
    """An owner's batches, newest first; `after`: those listed after that id."""
    q = _batch_query().where(batches.c.owner == owner)
    if after:
        mark = select(batches.c.created_at).where(batches.c.id == after, batches.c.owner == owner).scalar_subquery()
        q = q.where((batches.c.created_at, batches.c.id) < (mark, after))
    q = q.order_by(batches.c.created_at.desc(), batches.c.id.desc()).limit(limit)
    return [_batch(r) for r in (await conn.execute(q)).all()]


async def cancel_batch(conn: AsyncConnection, owner: str, batch_id: str) -> BatchRow | None:
    """Mark an in-progress batch `cancelling` (its workflow stops sending and writes what it finished);
    a batch that already ended or is cancelling is left as it is. None: no such batch of this owner."""
    await conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.owner == owner,
                                             batches.c.status == BatchStatus.IN_PROGRESS.value)
                       .values(status=BatchStatus.CANCELLING.value, cancelling_at=func.now()))
    return await get_batch(conn, owner, batch_id)


async def batch_state(conn: AsyncConnection, batch_id: str) -> tuple[BatchStatus, bool] | None:
    """(status, whether its window has passed) by the database clock; None: no such batch."""
    r = (await conn.execute(select(batches.c.status, batches.c.expires_at <= func.now())
                            .where(batches.c.id == batch_id))).first()
    return (BatchStatus(r[0]), bool(r[1])) if r else None


async def answered(conn: AsyncConnection, batch_id: str) -> set[str]:
    """The custom ids of the batch's requests whose answer is committed."""
    q = select(batch_results.c.custom_id).where(batch_results.c.batch_id == batch_id)
    return set((await conn.execute(q)).scalars())


@dataclass(frozen=True)
class Answer:
    """One request's answer, to record: its line, status and body (`{"request_id", "body"}`), and the usage
    to count under `model` (the name its line gave) when it is new."""

    custom_id: str
    line: int
    status_code: int
    body: dict
    model: str | None
    prompt_tokens: int
    completion_tokens: int


async def record_results(conn: AsyncConnection, batch: BatchRow, answers: list[Answer]) -> int:
    """Commit answers and, for those not committed before, their usage under the batch's tenant and key
    (2xx answers only: a request no engine took is charged nothing), in the caller's transaction. Returns
    how many were new; an answer already there (another attempt committed it first) adds nothing."""
    if not answers:
        return 0
    stmt = pg_insert(batch_results).values([
        {"batch_id": batch.id, "custom_id": a.custom_id, "line": a.line, "status_code": a.status_code, "body": a.body}
        for a in answers])
    r = await conn.execute(stmt.on_conflict_do_nothing(index_elements=["batch_id", "custom_id"])
                           .returning(batch_results.c.custom_id))
    new = set(r.scalars())
    rows: dict[usage_repo.RowKey, list[int]] = {}
    for a in answers:
        if a.custom_id in new and a.model is not None and 200 <= a.status_code < 300:
            acc = rows.setdefault((batch.tenant, batch.key_id, a.model), [0, 0, 0])
            acc[0] += 1
            acc[1] += a.prompt_tokens
            acc[2] += a.completion_tokens
    if rows:
        await usage_repo.add_now(conn, rows)
    return len(new)


async def results(conn: AsyncConnection, batch_id: str) -> list[ResultRow]:
    q = (select(batch_results.c.custom_id, batch_results.c.line, batch_results.c.status_code, batch_results.c.body)
         .where(batch_results.c.batch_id == batch_id).order_by(batch_results.c.line))
    return [ResultRow(*r) for r in (await conn.execute(q)).all()]


async def finish_batch(conn: AsyncConnection, batch_id: str, status: BatchStatus, output_file_id: str | None,
                       error_file_id: str | None) -> None:
    """The batch's final status, its files and the time of each step (finalizing, then the end)."""
    stamp = {BatchStatus.COMPLETED: "completed_at", BatchStatus.EXPIRED: "expired_at",
             BatchStatus.CANCELLED: "cancelled_at", BatchStatus.FAILED: "failed_at"}[status]
    await conn.execute(update(batches).where(and_(batches.c.id == batch_id,
                                                  batches.c.status.notin_([s.value for s in BatchStatus.ended()])))
                       .values(status=status.value, output_file_id=output_file_id, error_file_id=error_file_id,
                               finalizing_at=func.coalesce(batches.c.finalizing_at, func.now()),
                               **{stamp: func.now()}))


async def fail_batch(conn: AsyncConnection, batch_id: str, message: str) -> None:
    """A batch that could not run (its workflow did not start): `failed`, with why in `errors`."""
    await conn.execute(update(batches).where(batches.c.id == batch_id).values(
        status=BatchStatus.FAILED.value, failed_at=func.now(),
        errors={"object": "list", "data": [{"code": "batch_not_started", "message": message, "param": None,
                                            "line": None}]}))
