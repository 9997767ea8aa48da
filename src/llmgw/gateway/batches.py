"""OpenAI's Files and Batch APIs (issue 41): `/v1/files` and `/v1/batches`, as FastAPI routes.

A file is stored in Postgres (`batch_files`), owned by the key's tenant (`tenant:<name>`; a key of no
tenant owns its own, `key:<id>`; without keys, `-`): another owner's file or batch is a 404, as one that
does not exist. An upload is at most `batch_max_file_bytes` (refused with 413 from its `Content-Length`,
before the body is read, or as soon as a chunked body passes it) and `batch_max_lines` requests. Each line
is checked when a batch is created from the file (schemas/batches.py `parse_lines`): a file with bad lines
makes no batch (400 naming the first few).

A batch is a row in `batches` and a `BatchWorkflow` (id `batch/<id>`, on the control worker): its
activity sends each request to a gateway with a batch token (security/batch_token.py), which `serve`
recognises (`batch_identity`) and hands to the proxy as the batch's key, in the `batch` band.
"""

from __future__ import annotations

import email.parser
import email.policy
import logging
from datetime import datetime
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response
from temporalio.common import WorkflowIDConflictPolicy

from llmgw.db import batches_repo
from llmgw.gateway.openai_api import read_body
from llmgw.http import errors, jsonbody
from llmgw.http.errors import APIError
from llmgw.schemas.batches import (
    COMPLETION_WINDOWS, ENDPOINTS, LIST_LIMIT_MAX, MAX_FILENAME, MAX_METADATA_KEY, MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE, PURPOSE_INPUT, BatchInput, LineErrors, new_batch_id, new_file_id, parse_lines,
)
from llmgw.security import batch_token
from llmgw.workflows import attributes
from llmgw.workflows.ids import batch_workflow_id
from llmgw.workflows.queues import CONTROL_QUEUE

if TYPE_CHECKING:
    from llmgw.gateway.app import Gateway

log = logging.getLogger(__name__)
OWNER = "llmgw.owner"  # the scope key carrying (owner, key id, tenant) to these routes
MULTIPART_SLACK = 64 << 10  # a multipart body's envelope beside the file: boundaries, part headers, `purpose`
MAX_CREATE_BYTES = 64 << 10  # a `POST /v1/batches` body: ids, a window and metadata
_BEARER = b"bearer " + batch_token.PREFIX.encode()


def owner_of(identity: tuple[str, str | None] | None) -> tuple[str, str, str]:
    """(owner, key id, tenant) of a request's key (KeyRing.identify): what it may read and what a batch of it
    is counted against."""
    if identity is None:
        return "-", "", ""
    key_id, tenant = identity
    return (f"tenant:{tenant}", key_id, tenant) if tenant else (f"key:{key_id}", key_id, "")


def batch_identity(headers: list[tuple[bytes, bytes]], secret: bytes | None) -> tuple[str, str] | None | bool:
    """A batch's request (its `Authorization` carries a batch token): (batch id, key id); False: a batch
    token that does not verify; None: not a batch's request (one header scan, no hashing)."""
    for name, value in headers:
        if name == b"authorization" and value[:len(_BEARER)].lower() == _BEARER:
            found = batch_token.verify(secret, value[7:].decode("latin-1").strip())
            return found if found is not None else False
    return None


def _ts(t: datetime | None) -> int | None:
    return int(t.timestamp()) if t is not None else None


def page(rows: list, n: int, render) -> dict:
    """OpenAI's list object for the first `n` of `rows` (one more was read, to say `has_more`)."""
    return {"object": "list", "data": [render(r) for r in rows[:n]], "has_more": len(rows) > n,
            "first_id": rows[0].id if rows else None, "last_id": rows[:n][-1].id if rows else None}


def file_object(f: batches_repo.FileRow) -> dict:
    """OpenAI's FileObject."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": _ts(f.created_at), "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "expires_at": None, "status_details": None}


def batch_object(b: batches_repo.BatchRow) -> dict:
    """OpenAI's Batch object."""
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": b.errors, "input_file_id": b.input_file_id,
        "completion_window": b.completion_window, "status": b.status.value, "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id, "created_at": _ts(b.created_at), "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at), "finalizing_at": _ts(b.finalizing_at), "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at), "expired_at": _ts(b.expired_at), "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata,
    }


def _limit(limit: object) -> int:
    try:
        n = int(str(limit))
    except ValueError:
        raise errors.bad_request("`limit` must be an integer from 1 to 100", "limit") from None
    if not 1 <= n <= LIST_LIMIT_MAX:
        raise errors.bad_request(f"`limit` must be from 1 to {LIST_LIMIT_MAX}, not {n}", "limit")
    return n


def _form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise errors.bad_request("an upload is multipart/form-data with `file` and `purpose`", "file")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        raise errors.bad_request("the multipart body could not be read", "file")
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            out[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return out


def _metadata(value: object) -> dict | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_METADATA_KEY
                   or len(v) > MAX_METADATA_VALUE for k, v in value.items())):
        raise errors.bad_request(f"`metadata` is at most {MAX_METADATA_PAIRS} string pairs, keys of at most "
                                 f"{MAX_METADATA_KEY} and values of at most {MAX_METADATA_VALUE} characters", "metadata")
    return value


def files_and_batches(gw: "Gateway") -> APIRouter:
    """The routes of `/v1/files` and `/v1/batches`."""
    router = APIRouter()
    settings = gw.settings
    max_bytes, max_lines = settings.batch_max_file_bytes, settings.batch_max_lines

    def who(request: Request) -> tuple[str, str, str]:
        return request.scope.get(OWNER) or ("-", "", "")

    def file_missing(file_id: str, param: str = "file_id") -> APIError:
        return APIError(404, f"no file with id {file_id[:64]!r}", param=param, code="file_not_found")

    def batch_missing(batch_id: str) -> APIError:
        return APIError(404, f"no batch with id {batch_id[:64]!r}", param="batch_id", code="batch_not_found")

    @router.post("/v1/files")
    async def create_file(request: Request):
        owner = who(request)[0]
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes + MULTIPART_SLACK:
            raise APIError(413, f"a file is at most {max_bytes} bytes (batch_max_file_bytes); this upload "
                           f"is {declared}", param="file", code="file_too_large")
        try:
            body = await read_body(request.receive, max_bytes + MULTIPART_SLACK)
        except APIError:
            raise APIError(413, f"a file is at most {max_bytes} bytes (batch_max_file_bytes)", param="file",
                           code="file_too_large") from None
        form = _form(request.headers.get("content-type", ""), body)
        purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose != PURPOSE_INPUT:
            raise errors.bad_request(f"`purpose` must be {PURPOSE_INPUT!r} (the only files this gateway keeps "
                                     f"are batch inputs), not {purpose[:64]!r}", "purpose")
        if "file" not in form:
            raise errors.bad_request("no `file` part in the upload", "file")
        filename, content = form["file"]
        if len(content) > max_bytes:
            raise APIError(413, f"a file is at most {max_bytes} bytes (batch_max_file_bytes); this one is "
                           f"{len(content)}", param="file", code="file_too_large")
        lines = content.count(b"\n") + (not content.endswith(b"\n"))
        if lines > max_lines:
            raise errors.bad_request(f"a batch file holds at most {max_lines} lines (batch_max_lines); this one "
                                     f"holds {lines}", "file")
        async with gw.engine.begin() as conn:
            row = await batches_repo.add_file(conn, new_file_id(), owner, (filename or "upload.jsonl")[:MAX_FILENAME],
                                              PURPOSE_INPUT, content)
        return file_object(row)

    @router.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: str = "20"):
        n = _limit(limit)
        async with gw.engine.connect() as conn:
            rows = await batches_repo.list_files(conn, who(request)[0], purpose, after, n + 1)
        return page(rows, n, file_object)

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        async with gw.engine.connect() as conn:
            row = await batches_repo.get_file(conn, who(request)[0], file_id)
        if row is None:
            raise file_missing(file_id)
        return file_object(row)

    @router.get("/v1/files/{file_id}/content")
    async def get_content(file_id: str, request: Request):
        async with gw.engine.connect() as conn:
            data = await batches_repo.file_content(conn, who(request)[0], file_id)
        if data is None:
            raise file_missing(file_id)
        return Response(data, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        async with gw.engine.begin() as conn:
            gone = await batches_repo.delete_file(conn, who(request)[0], file_id)
        if not gone:
            raise file_missing(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        owner, key_id, tenant = who(request)
        try:
            req = jsonbody.decode(await read_body(request.receive, MAX_CREATE_BYTES))
        except jsonbody.JSONRefused as exc:
            raise errors.bad_request(str(exc), None) from None
        if not isinstance(req, dict):
            raise errors.bad_request("the body must be a JSON object", None)
        endpoint, window, file_id = req.get("endpoint"), req.get("completion_window"), req.get("input_file_id")
        if endpoint not in ENDPOINTS:
            raise errors.bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise errors.bad_request(f"`completion_window` must be one of {', '.join(COMPLETION_WINDOWS)}",
                                     "completion_window")
        if not isinstance(file_id, str) or not file_id:
            raise errors.bad_request("`input_file_id` must be a file's id", "input_file_id")
        metadata = _metadata(req.get("metadata"))
        if gw.batch_secret is None:
            raise APIError(503, "batches need a secret the gateways and control workers share: set "
                           "LLMGW_CACHE_SALT_SECRET, or use a database URL with a password", type="server_error",
                           code="batches_unavailable")
        client = gw.temporal.client
        if client is None:
            raise errors.unavailable("batches", "Temporal is not reachable yet")
        async with gw.engine.connect() as conn:
            content = await batches_repo.file_content(conn, owner, file_id)
        if content is None:
            raise file_missing(file_id, "input_file_id")
        try:
            lines = parse_lines(content, endpoint, max_lines)
        except LineErrors as exc:
            raise errors.bad_request(str(exc), "input_file_id") from None
        batch_id = new_batch_id()
        async with gw.engine.begin() as conn:
            row = await batches_repo.add_batch(conn, batch_id, owner, key_id, tenant, endpoint, file_id,
                                               COMPLETION_WINDOWS[window], window, len(lines), metadata)
        try:
            sa = await gw.temporal.attributes.registered(client)
            await client.start_workflow(
                "BatchWorkflow", BatchInput(batch_id=batch_id), id=batch_workflow_id(batch_id),
                task_queue=CONTROL_QUEUE, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                memo={"batch": batch_id, "endpoint": endpoint, "tenant": tenant, "requests": len(lines)},
                search_attributes=attributes.lifecycle("batch") if sa else None)
        except Exception as exc:  # noqa: BLE001 - the batch cannot run: say so on it and to the client
            log.exception("starting the workflow of batch %s failed", batch_id)
            async with gw.engine.begin() as conn:
                await batches_repo.fail_batch(conn, batch_id, f"its workflow could not be started: {exc}"[:500])
            raise errors.unavailable("batches", "its workflow could not be started") from None
        return batch_object(row)

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: str = "20"):
        n = _limit(limit)
        async with gw.engine.connect() as conn:
            rows = await batches_repo.list_batches(conn, who(request)[0], after, n + 1)
        return page(rows, n, batch_object)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        async with gw.engine.connect() as conn:
            row = await batches_repo.get_batch(conn, who(request)[0], batch_id)
        if row is None:
            raise batch_missing(batch_id)
        return batch_object(row)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        async with gw.engine.begin() as conn:
            row = await batches_repo.cancel_batch(conn, who(request)[0], batch_id)
        if row is None:
            raise batch_missing(batch_id)
        return batch_object(row)

    return router

