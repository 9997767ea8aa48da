"""The hot path: OpenAI inference requests relayed to a Ready replica, as a bare ASGI handler.

Measured choice (issue 5): FastAPI + httpx adds milliseconds per request; a bare ASGI handler with one
shared aiohttp session adds a fraction of one, so inference requests bypass the framework while FastAPI
owns everything else.

- The body is read once and passed on as bytes; fields we do not know reach the engine untouched. Only
  an alias is rewritten to the model's name.
- Least-outstanding-requests across Ready replicas; a connection that fails before anything was sent
  to the client is retried on another replica.
- Streams are relayed chunk by chunk as they arrive (no buffering, no Content-Length), bytes untouched,
  so multi-byte characters split across writes reach the client whole. A client that disconnects
  cancels the upstream request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

import aiohttp

from llmgw.gateway import errors
from llmgw.gateway.errors import APIError
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable

log = logging.getLogger(__name__)

# path -> the field a request must carry besides `model`
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}
HOP_HEADERS = {b"content-type"}

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def send_error(send: Send, err: APIError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def parse_request(path: str, body: bytes) -> dict[str, Any]:
    """Decode and check the request; raises a 400 `APIError` naming the field."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise errors.bad_request("the request body is not valid JSON") from None
    if not isinstance(req, dict):
        raise errors.bad_request("the request body must be a JSON object")
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("`model` is required: the name of a model from /v1/models", param="model")
    field = REQUIRED[path]
    value = req.get(field)
    if value is None or (field == "messages" and (not isinstance(value, list) or not value)):
        what = "a non-empty list of {role, content} messages" if field == "messages" else "required"
        raise errors.bad_request(f"`{field}` is {what}", param=field)
    if "stream" in req and not isinstance(req["stream"], bool):
        raise errors.bad_request("`stream` must be true or false", param="stream")
    return req


class Usage:
    """Per-model requests in flight and last use on this gateway, flushed to Postgres by the app."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.ended: set[str] = set()

    def begin(self, model: str) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1

    def end(self, model: str) -> None:
        self.in_flight[model] -= 1
        self.ended.add(model)

    def take(self) -> set[str]:
        """Models to mark used now: those with requests in flight and those that ended since last time."""
        out = {m for m, n in self.in_flight.items() if n > 0} | self.ended
        self.ended = set()
        return out


class Proxy:
    """The ASGI handler for POST /v1/chat/completions, /v1/completions and /v1/embeddings."""

    def __init__(self, routes: RouteTable, on_missing: Callable[[ModelRoute, str], Awaitable[ModelRoute]],
                 upstream_timeout_s: float = 300.0, metrics: Any = None):
        self.routes = routes
        self.on_missing = on_missing
        self.upstream_timeout_s = upstream_timeout_s
        self.usage = Usage()
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.upstream_timeout_s),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        path = scope["path"]
        started = time.perf_counter()
        metric_model = "unknown"  # never a client-chosen string: label cardinality stays bounded
        status = 500
        try:
            body = await read_body(receive)
            req = parse_request(path, body)
            model_name = req["model"]
            route = self.routes.resolve(model_name)
            if route is None:
                raise errors.model_not_found(model_name)
            if not route.endpoints:
                route = await self.on_missing(route, model_name)
            name = metric_model = route.model.name
            if model_name != name:
                req["model"] = name
                body = json.dumps(req).encode()
            self.usage.begin(name)
            try:
                status = await self._forward(route, path, body, bool(req.get("stream")), receive, send)
            finally:
                self.usage.end(name)
        except APIError as err:
            status = err.status
            await send_error(send, err)
        except ConnectionResetError:
            status = 499
        finally:
            if self.metrics is not None:
                self.metrics.observe(metric_model, status, time.perf_counter() - started)

    async def _forward(self, route: ModelRoute, path: str, body: bytes, stream: bool, receive: Receive, send: Send) -> int:
        assert self.session is not None
        tried: set[str] = set()
        last_error = "no replica"
        while True:
            candidates = [e for e in route.endpoints if e.replica_id not in tried]
            if not candidates:
                raise errors.upstream_failed(last_error)
            ep = min(candidates, key=lambda e: e.outstanding)
            tried.add(ep.replica_id)
            ep.outstanding += 1
            try:
                return await self._relay(ep, path, body, receive, send)
            except _NotSent as exc:
                last_error = str(exc)
                log.warning("replica %s at %s failed before the first byte (%s); trying another", ep.replica_id, ep.url, exc)
            finally:
                ep.outstanding -= 1

    async def _relay(self, ep: Endpoint, path: str, body: bytes, receive: Receive, send: Send) -> int:
        assert self.session is not None
        try:
            resp = await self.session.post(ep.url + path, data=body, headers={"Content-Type": "application/json"})
        except asyncio.TimeoutError:
            raise errors.upstream_timeout(self.upstream_timeout_s) from None
        except aiohttp.ClientError as exc:
            raise _NotSent(f"{type(exc).__name__}: {exc}") from None
        try:
            headers = [(b"content-type", resp.headers.get("Content-Type", "application/json").encode())]
            relay = asyncio.ensure_future(self._stream(resp, headers, send))
            disconnect = asyncio.ensure_future(_wait_disconnect(receive))
            done, _ = await asyncio.wait([relay, disconnect], return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:
                relay.cancel()  # the client went away: closing the upstream response cancels the engine's work
                await asyncio.gather(relay, return_exceptions=True)
                return 499
            disconnect.cancel()
            return relay.result()
        finally:
            resp.close()

    async def _stream(self, resp: aiohttp.ClientResponse, headers: list, send: Send) -> int:
        started = False
        try:
            first = await resp.content.readany()
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            started = True
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            while True:
                chunk = await resp.content.readany()
                if not chunk:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return resp.status
        except asyncio.TimeoutError:
            if not started:
                raise errors.upstream_timeout(self.upstream_timeout_s) from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return 504
        except aiohttp.ClientError as exc:
            if not started:
                raise errors.upstream_failed(f"{type(exc).__name__}: {exc}") from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return 502


class _NotSent(Exception):
    """The upstream failed before anything reached the client: safe to retry elsewhere."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
