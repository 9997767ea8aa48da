"""Files and batches (issue 41): OpenAI's Batch API as llmgw serves it. Limits, statuses, ids, the batch
file's line rules, and the payloads of `BatchWorkflow` and its activities. Pure: imported by the gateway,
the control activities and workflow code.

A batch file is JSONL, one request a line, as OpenAI's:
`{"custom_id": "r-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`. Each line is
checked when the batch is created (`parse_lines`): JSON, an object, a `custom_id` (a string of 1 to 512
characters, unique in the file), `method` POST, `url` the batch's endpoint, `body` an object with a
`model`. A file with bad lines is refused whole, naming the first `SHOWN_ERRORS` of them.
"""

from __future__ import annotations

import json
import secrets
from enum import StrEnum

from llmgw.schemas.wire import WireModel as _Wire

# What a batch may ask for: the gateway's own endpoints (gateway/openai_api.py REQUIRED, and the Responses
# door), in OpenAI's Batch API spelling.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only window
MAX_CUSTOM_ID = 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata bounds
SHOWN_ERRORS = 5  # bad lines named in a 400
MAX_FILENAME = 256
LIST_LIMIT_MAX = 100  # `limit` of a list, as OpenAI's (1 to 100, default 20)
PURPOSE_INPUT = "batch"  # the only purpose an upload may have
PURPOSE_OUTPUT = "batch_output"  # files a batch writes


class BatchStatus(StrEnum):
    """OpenAI's batch statuses. llmgw validates a file before it makes a batch (a bad file is a 400, no
    batch), so a batch starts `in_progress`; `validating` and `failed` are never stored."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @classmethod
    def ended(cls) -> frozenset["BatchStatus"]:
        return frozenset({cls.FAILED, cls.COMPLETED, cls.EXPIRED, cls.CANCELLED})


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's `output` or `error` file: fixed by the batch, so a retried write makes no second."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


class BatchLine(_Wire):
    """One request of a batch file: its 1-based line number, `custom_id` and request body."""

    line: int
    custom_id: str
    body: dict


class LineErrors(ValueError):
    """The file's bad lines: `errors` holds (line number, message) of the first `SHOWN_ERRORS`, `count` all."""

    def __init__(self, errors: list[tuple[int, str]], count: int):
        self.errors = errors
        self.count = count
        shown = "; ".join(f"line {n}: {m}" for n, m in errors)
        more = f" (and {count - len(errors)} more)" if count > len(errors) else ""
        super().__init__(f"{count} bad line{'s' if count != 1 else ''} in the batch file: {shown}{more}")


def _line_error(obj: object, endpoint: str, seen: set[str]) -> str | None:
    if not isinstance(obj, dict):
        return "not a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not 1 <= len(cid) <= MAX_CUSTOM_ID:
        return f"`custom_id` must be a string of 1 to {MAX_CUSTOM_ID} characters"
    if cid in seen:
        return f"`custom_id` {cid[:64]!r} is used by an earlier line (each must be unique)"
    if obj.get("method") != "POST":
        return "`method` must be \"POST\""
    if obj.get("url") != endpoint:
        return f"`url` must be the batch's endpoint {endpoint!r}, not {str(obj.get('url'))[:64]!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "`body` must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "`body.model` must be a model's name"
    if body.get("stream") is True:
        return "`body.stream` must not be true in a batch"
    return None


def parse_lines(content: bytes, endpoint: str, max_lines: int) -> list[BatchLine]:
    """The requests of a batch file for `endpoint`, in order. Empty lines are skipped. Raises `LineErrors`
    for bad lines (all are counted, the first few named), or for more than `max_lines` requests or none."""
    out: list[BatchLine] = []
    seen: set[str] = set()
    errors: list[tuple[int, str]] = []
    count = 0
    for n, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(out) + count >= max_lines:
            raise LineErrors([(n, f"the file holds more than {max_lines} requests (the most a batch takes)")], 1)
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            err: str | None = "not JSON"
        else:
            err = _line_error(obj, endpoint, seen)
        if err is not None:
            count += 1
            if len(errors) < SHOWN_ERRORS:
                errors.append((n, err))
            continue
        seen.add(obj["custom_id"])
        out.append(BatchLine(line=n, custom_id=obj["custom_id"], body=obj["body"]))
    if count:
        raise LineErrors(errors, count)
    if not out:
        raise LineErrors([(0, "the file holds no requests")], 1)
    return out


# ---- BatchWorkflow and its activities -----------------------------------------------------------

class BatchInput(_Wire):
    """`BatchWorkflow`'s input: the batch's id. `rounds`: activity rounds run by earlier runs of this
    workflow (continue-as-new carries it)."""

    batch_id: str
    rounds: int = 0


class RunBatchInput(_Wire):
    """Send up to `limit` of the batch's unanswered requests through a gateway, `parallel` at a time."""

    batch_id: str
    limit: int = 1000


class RunBatchResult(_Wire):
    """`ended`: nothing more to send (`reason`: `completed`, `cancelled`, `expired`); else more remain.
    `answered`: requests answered by this activity."""

    ended: bool
    reason: str = ""
    answered: int = 0


class FinishBatchInput(_Wire):
    """Write the batch's output and error files and its final status (`reason` as `RunBatchResult`'s)."""

    batch_id: str
    reason: str


class FinishBatchResult(_Wire):
    status: str
    completed: int = 0
    failed: int = 0
