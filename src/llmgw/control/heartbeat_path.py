"""`POST /node/v1/heartbeat` served before FastAPI (issue 42): the steady-state heartbeat, every node's
most frequent request, without FastAPI's routing, dependencies and response model, and in batches
(control/heartbeat_batch.py).

It keeps every check of the FastAPI route, in the same order and with the same answers:
- the body was read within the listener's limits and `check`ed by `BoundedJSON` (depth, counts, numbers);
- it is parsed as Starlette parses it (`json.loads`) and validated as FastAPI validates it
  (`HeartbeatRequest.model_validate`);
- the client certificate must name the node the beat claims and not be on the deny-list (`check_identity`:
  401/403/503, rendered as the route's exception handler renders them);
- the answer is the route's own bytes: `HeartbeatResponse` without `stop` when it is None, compact JSON.

Whatever it does not serve itself goes to the FastAPI route, body replayed, and is answered there exactly as
before: a body that is not JSON or not a heartbeat (the 400 naming each field), a content type FastAPI would
not parse as JSON, and a heartbeat that carries an inventory or download progress (rare: the service's
per-beat path, which pins a peer listener and records progress).
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from pydantic import ValidationError

from llmgw.control.fleet_service import batchable
from llmgw.control.heartbeat_batch import HeartbeatBatcher
from llmgw.http.errors import APIError, json_error, unexpected
from llmgw.schemas.api import HeartbeatRequest, HeartbeatResponse

PATH = "/node/v1/heartbeat"
_HEADERS = [(b"content-type", b"application/json")]


def answer_bytes(resp: HeartbeatResponse) -> bytes:
    """`resp` as the FastAPI route sends it (`response_model_exclude_none`, Starlette's `JSONResponse`)."""
    return json.dumps(resp.model_dump(mode="json", by_alias=True, exclude_none=True), ensure_ascii=False,
                      allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


_COMMON = {(True, False): answer_bytes(HeartbeatResponse(ok=True, reregister=False)),
           (False, True): answer_bytes(HeartbeatResponse(ok=False, reregister=True))}


def _json_content(scope: dict) -> bool:
    """The request says its body is `application/json` (parameters aside), which FastAPI parses as JSON.
    Other types FastAPI also parses (`+json`) take the route, which answers them as it always did."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _no_body() -> dict:
    return {"type": "http.disconnect"}


class HeartbeatPath:
    """The handler `BoundedJSON(app, lean={PATH: HeartbeatPath(...)})` calls. `identify(scope, node_id)`
    raises the `APIError` that refuses the request's certificate (nodeapi.check_identity)."""

    def __init__(self, batcher: HeartbeatBatcher, identify: Callable[[dict, str], object]):
        self.batcher = batcher
        self.identify = identify

    async def __call__(self, scope: dict, body: bytes, send, route: Callable[[], Awaitable[None]]) -> None:
        if not _json_content(scope):
            await route()
            return
        try:
            req = HeartbeatRequest.model_validate(json.loads(body))
        except (ValueError, ValidationError, RecursionError):  # the route's 400, worded as it words it
            await route()
            return
        if not batchable(req):
            await route()
            return
        try:
            self.identify(scope, req.node_id)
            resp = await self.batcher.beat(req)
        except APIError as exc:
            await json_error(exc)(scope, _no_body, send)
            return
        except Exception as exc:  # noqa: BLE001 - answered as the route's handlers answer it
            await json_error(unexpected(scope["method"], scope["path"], exc, "the node API"))(scope, _no_body, send)
            return
        data = _COMMON.get((resp.ok, resp.reregister)) if resp.stop is None else None
        if data is None:
            data = answer_bytes(resp)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(data)), *_HEADERS]})
        await send({"type": "http.response.body", "body": data})
