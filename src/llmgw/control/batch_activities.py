"""`BatchWorkflow`'s activities (issue 41), on the control worker.

`run_batch_requests` sends a batch's unanswered requests to a gateway over HTTP (`batch_gateway_url`), with
the batch's token (security/batch_token.py): the gateway serves each as the key that made the batch, through
its own admission (the key's models and limits, the model's slots), in the `batch` band of a saturated model,
so a batch never takes a slot an interactive request is waiting for. Why HTTP and not the proxy in this
process: the admission that matters (a model's `max_concurrency` slots, the fair queues) is each gateway's
own memory; a control worker calling the proxy's code would have slots of its own, outside the gateways'.

Each answer is committed with its usage in one transaction keyed by (batch id, custom id)
(db/batches_repo.py `record_results`; the answers of the last `COMMIT_S` together): a request whose answer is committed is never sent again; one whose
answer was lost to a restart (of this worker, or of the gateway) is sent again; usage is added only when the
answer's row is new, so it is counted once. The gateway counts nothing for a batch's request.

Answers the batch cannot take as final (429, 502, 503, 504, no connection) are retried in the round, at most
`RETRY_MAX_S` apart, while the batch is in progress and inside its window. Every other answer, a 400 or a
403 included, is the request's answer (the error file). The round stops when it has answered its `limit`,
the batch is cancelled, or its window passed; requests in flight then are waited for and kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmgw.config import Settings
from llmgw.db import batches_repo
from llmgw.schemas.batches import (
    PURPOSE_OUTPUT, BatchLine, BatchStatus, FinishBatchInput, FinishBatchResult, LineErrors, RunBatchInput,
    RunBatchResult, output_file_id, parse_lines,
)
from llmgw.security.batch_token import batch_secret, batch_token

log = logging.getLogger(__name__)
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
RETRY_MAX_S = 5.0
CHECK_S = 1.0  # how often a round reads the batch's status (cancelled?) and window
COMMIT_S = 0.05  # answers that arrive within this long are committed in one transaction
MAX_ERROR_TEXT = 2000
_ENDED = {"completed": BatchStatus.COMPLETED, "expired": BatchStatus.EXPIRED, "cancelled": BatchStatus.CANCELLED,
          "failed": BatchStatus.FAILED}


def _answer_body(resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return {"error": {"message": resp.text[:MAX_ERROR_TEXT], "type": "api_error", "param": None, "code": None}}


def _usage(body: dict) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer: chat, completions and embeddings (`prompt_tokens`,
    `completion_tokens`) or Responses (`input_tokens`, `output_tokens`)."""
    u = body.get("usage")
    if not isinstance(u, dict):
        return 0, 0

    def n(*names: str) -> int:
        for k in names:
            v = u.get(k)
            if type(v) is int and v >= 0:
                return v
        return 0
    return n("prompt_tokens", "input_tokens"), n("completion_tokens", "output_tokens")


class _Committer:
    """Commits a round's answers in groups: each `add` joins the transaction that starts `COMMIT_S` after the
    first answer not yet committed (one transaction for about `batch_parallel` answers, not one each). An
    answer lost with its process before its commit is sent again; `done()` waits for every commit and
    raises what failed, which fails the round (it is retried)."""

    def __init__(self, engine: AsyncEngine, batch: batches_repo.BatchRow):
        self.engine = engine
        self.batch = batch
        self.pending: list[batches_repo.Answer] = []
        self.flushes: list[asyncio.Task] = []
        self.answered = 0

    def add(self, answer: batches_repo.Answer) -> None:
        self.pending.append(answer)
        if len(self.pending) == 1:
            self.flushes.append(asyncio.create_task(self._flush()))

    async def _flush(self) -> None:
        await asyncio.sleep(COMMIT_S)
        answers, self.pending = self.pending, []
        async with self.engine.begin() as conn:
            self.answered += await batches_repo.record_results(conn, self.batch, answers)

    async def done(self) -> None:
        await asyncio.gather(*self.flushes)


class BatchActivities:
    """Bound to the database engine and settings. Register `all()` on the control worker."""

    def __init__(self, engine: AsyncEngine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.secret = batch_secret(settings.cache_salt_secret, settings.database_url)

    def all(self) -> list:
        return [self.run_batch_requests, self.finish_batch]

    async def _lines(self, conn, batch: batches_repo.BatchRow) -> list[BatchLine] | None:
        content = await batches_repo.file_content(conn, None, batch.input_file_id)
        if content is None:
            return None
        try:
            return parse_lines(content, batch.endpoint, 1 << 30)  # checked at creation: this only reads it
        except LineErrors:
            return None

    @activity.defn(name="run_batch_requests")
    async def run_batch_requests(self, inp: RunBatchInput) -> RunBatchResult:
        async with self.engine.connect() as conn:
            batch = await batches_repo.get_batch(conn, None, inp.batch_id)
            if batch is None:
                raise ApplicationError(f"no batch {inp.batch_id}", non_retryable=True)
            state = await batches_repo.batch_state(conn, inp.batch_id)
            lines = await self._lines(conn, batch)
            done = await batches_repo.answered(conn, inp.batch_id)
        assert state is not None
        if (stop := self._stopped(*state)) is not None:
            return RunBatchResult(ended=True, reason=stop)
        if lines is None:
            return RunBatchResult(ended=True, reason="failed")
        if self.secret is None:
            raise ApplicationError("batches need LLMGW_CACHE_SALT_SECRET or a database URL with a password, "
                                   "alike on the gateways and the control workers", non_retryable=True)
        pending = [line for line in lines if line.custom_id not in done]
        todo = pending[:inp.limit]
        commits = _Committer(self.engine, batch)
        stop_reason: list[str] = []
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)
        url = self.settings.resolved_batch_gateway_url + batch.endpoint
        headers = {"authorization": f"Bearer {batch_token(self.secret, batch.id, batch.key_id)}"}

        async def watch() -> None:
            """Read the batch's status and window every `CHECK_S`; heartbeat the progress."""
            while not stop_reason:
                activity.heartbeat(commits.answered)
                await asyncio.sleep(CHECK_S)
                async with self.engine.connect() as c:
                    st = await batches_repo.batch_state(c, batch.id)
                if st is not None and (why := self._stopped(*st)) is not None:
                    stop_reason.append(why)

        async def send(http: httpx.AsyncClient, line: BatchLine) -> None:
            delay = 0.5
            while not stop_reason:
                try:
                    resp = await http.post(url, json=line.body, headers=headers)
                except httpx.HTTPError as exc:
                    log.info("batch %s, %s: the gateway could not be reached (%s); retrying", batch.id,
                             line.custom_id, exc)
                    resp = None
                if resp is not None and resp.status_code not in RETRY_STATUSES:
                    body = _answer_body(resp)
                    prompt, completion = _usage(body)
                    model = line.body.get("model")
                    commits.add(batches_repo.Answer(
                        line.custom_id, line.line, resp.status_code,
                        {"request_id": resp.headers.get("x-request-id", ""), "body": body},
                        model if isinstance(model, str) else None, prompt, completion))
                    return
                wait = delay
                if resp is not None and (ra := resp.headers.get("retry-after", "")).isdigit():
                    wait = max(wait, float(ra))
                await asyncio.sleep(min(wait, RETRY_MAX_S) * (0.5 + random.random() / 2))
                delay = min(delay * 2, RETRY_MAX_S)

        async def worker(http: httpx.AsyncClient) -> None:
            while not stop_reason:
                try:
                    line = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await send(http, line)

        watcher = asyncio.create_task(watch())
        try:
            timeout = httpx.Timeout(self.settings.upstream_timeout_s + self.settings.load_wait_s, connect=5.0)
            async with httpx.AsyncClient(timeout=timeout) as http:
                await asyncio.gather(*(worker(http) for _ in range(min(self.settings.batch_parallel, len(todo)))))
            await commits.done()
        finally:
            watcher.cancel()
        log.info("batch %s: a round (attempt %d) answered %d of %d requests%s", batch.id, activity.info().attempt,
                 commits.answered, len(todo), f" ({stop_reason[0]})" if stop_reason else "")
        if stop_reason:
            return RunBatchResult(ended=True, reason=stop_reason[0], answered=commits.answered)
        left = len(pending) - len(todo)
        return RunBatchResult(ended=left == 0 and queue.empty(), reason="completed", answered=commits.answered)

    @staticmethod
    def _stopped(status: BatchStatus, expired: bool) -> str | None:
        if status == BatchStatus.CANCELLING:
            return "cancelled"
        if status in BatchStatus.ended():
            return "cancelled" if status == BatchStatus.CANCELLED else status.value
        if expired:
            return "expired"
        return None

    @activity.defn(name="finish_batch")
    async def finish_batch(self, inp: FinishBatchInput) -> FinishBatchResult:
        async with self.engine.begin() as conn:
            batch = await batches_repo.get_batch(conn, None, inp.batch_id)
            if batch is None:
                raise ApplicationError(f"no batch {inp.batch_id}", non_retryable=True)
            if batch.status in BatchStatus.ended():
                return FinishBatchResult(status=batch.status.value, completed=batch.completed, failed=batch.failed)
            lines = await self._lines(conn, batch) or []
            results = await batches_repo.results(conn, inp.batch_id)
            out, err = [], []
            for r in results:
                entry = {"id": f"batch_req_{batch.id.removeprefix('batch_')}_{r.line}", "custom_id": r.custom_id,
                         "response": {"status_code": r.status_code, "request_id": r.body.get("request_id", ""),
                                      "body": r.body.get("body")}, "error": None}
                (out if 200 <= r.status_code < 300 else err).append(json.dumps(entry))
            have = {r.custom_id for r in results}
            status = _ENDED.get(inp.reason, BatchStatus.FAILED)
            if status != BatchStatus.COMPLETED:
                code = {BatchStatus.EXPIRED: "batch_expired", BatchStatus.CANCELLED: "batch_cancelled"}.get(
                    status, "batch_failed")
                for line in lines:
                    if line.custom_id not in have:
                        err.append(json.dumps({
                            "id": f"batch_req_{batch.id.removeprefix('batch_')}_{line.line}",
                            "custom_id": line.custom_id, "response": None,
                            "error": {"code": code, "message": f"the batch ended ({status.value}) before this "
                                      "request was answered"}}))
            out_id = err_id = None
            if out:
                out_id = output_file_id(batch.id, "output")
                await batches_repo.add_file(conn, out_id, batch.owner, f"{batch.id}_output.jsonl", PURPOSE_OUTPUT,
                                            ("\n".join(out) + "\n").encode())
            if err:
                err_id = output_file_id(batch.id, "error")
                await batches_repo.add_file(conn, err_id, batch.owner, f"{batch.id}_error.jsonl", PURPOSE_OUTPUT,
                                            ("\n".join(err) + "\n").encode())
            await batches_repo.finish_batch(conn, batch.id, status, out_id, err_id)
            completed = sum(1 for r in results if 200 <= r.status_code < 300)
        return FinishBatchResult(status=status.value, completed=completed, failed=len(results) - completed)
