"""The hot path: OpenAI inference requests relayed to a Ready replica, as a bare ASGI handler.

Measured choice (issue 5, bench/overhead.py): FastAPI adds work per request that the relay does not need,
and aiohttp's client costs three times the CPU of `gateway/upstream.py`; so POST /v1/chat/completions,
/v1/completions and /v1/embeddings come here straight from the ASGI server, and FastAPI owns the rest.

For each request:
- the body is read once and passed on as bytes, so fields we do not know reach the engine untouched;
  only an alias (or a fallback) is rewritten to the serving model's name;
- a guard policy's request check runs first (gateway/guard.py);
- the route: the model's Ready replicas, then its fallbacks' in catalog order; with none at all, the
  model is loaded on demand (gateway/demand.py);
- the model's concurrency gate (gateway/admission.py; when it is full, the request waits in its tenant's
  queue, served by weighted fair queuing in tokens: gateway/fairness.py), then least-outstanding balancing with a circuit
  breaker per endpoint (gateway/balancer.py); a replica that fails before anything reached the client
  (no connection, or a 502/503/504 answer) is replaced by another;
- the answer keeps OpenAI's contract whatever the engine sends: a non-streaming request gets one JSON
  body, read whole before its status is sent (an answer cut mid-body is a 502, never a short 200); a
  streaming one gets well-formed events relayed as each completes (no Content-Length, bytes untouched, so
  multi-byte characters split across writes reach the client whole) and exactly one `data: [DONE]`,
  after an error event if the engine broke off (gateway/sse.py);
- a client that disconnects cancels the request wherever it is (queued, loading, streaming), and the
  engine's connection is dropped, which cancels its work;
- a request with an accounted key (gateway/quotas.py) is admitted against its tenant's and key's limits
  before anything else (403/429), carries their `x-ratelimit-*` headers, asks a streaming engine for usage
  when the client did not (and drops that chunk again), and has its answer's `usage` counted once when it
  ends. Every other request skips all of it: one `is None` test per request and per relayed chunk;
- a request of another API (Anthropic's POST /v1/messages, OpenAI's POST /v1/responses: a `Door`) is
  translated into a chat completion as it is read and takes every step above as one; its answer, its
  events and its errors are translated back as they are sent (gateway/messages.py, gateway/responses.py).
  A Messages request to a replica whose engine serves Messages itself (gateway/dialects.py) is sent as it
  came instead, with the same rules applied, and its answer and events relayed in their own framing
  (gateway/messages_native.py); each replica gets what it speaks, request by request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from typing import Any, Awaitable, Callable

from llmgw.http import errors
from llmgw.gateway.admission import Gate, Gates
from llmgw.gateway.balancer import Balancer
from llmgw.gateway.demand import HELD_FOR, Demand, Hold
from llmgw.gateway.fairness import BATCH, request_cost, share_of
from llmgw.http.errors import APIError
from llmgw.gateway.guard import Guard, answer_text, conversation
from llmgw.gateway import messages, messages_native
from llmgw.gateway.dialects import Dialects
from llmgw.gateway.messages import Door, MessagesDoor
from llmgw.gateway.messages_native import NativeFrames
from llmgw.gateway.media import check_media, has_parts, media_urls
from llmgw.gateway.isolation import Isolated, Isolation
from llmgw.gateway.prefix import prefix_key
from llmgw.gateway.openai_api import (
    MAX_BODY, Receive, Send, engine_error, media_part, parse_request, prompt_chars, prompt_param,
    read_body,
    sse_error,
)
from llmgw.gateway.quotas import CHARS_PER_TOKEN, Account, Meter, Quotas
from llmgw.gateway.resume import Splice, refusal
from llmgw.http.errors import send_error
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.sse import DONE, SSEFrames, StreamBroken
from llmgw.gateway.tokens import USAGE
from llmgw.gateway.upstream import (
    AnswerTooLarge, ConnectFailed, Response, Upstream, UpstreamBroken, UpstreamError, UpstreamTimeout,
)
from llmgw.http.response_head import EXTENSION as HEAD
from llmgw.gateway.adapters import AdapterLoads, lora_field
from llmgw.schemas.catalog import Adapter, GuardPolicy
from llmgw.security.logtext import printable
from llmgw.telemetry import GatewayMetrics, trace_route, tracing_enabled

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
GUARDED = (CHAT, "/v1/completions")
MAX_HELD = 16 << 20  # an answer held for a response check
MAX_ANSWER = 64 << 20  # a non-streamed answer, which is read whole before its status is sent
SSE = b"text/event-stream"
STREAM_HEADERS = [(b"content-type", SSE), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
# The error event of a stream that ended mid-event: made once, not at the end of every stream (issue 42:
# building it was ~7 % of a short stream's CPU in the gateway).
_MID_EVENT = sse_error(errors.upstream_failed("its stream ended mid-event"))
RETRYABLE = (401, 403, 429, 502, 503, 504)  # engine answers another replica may not give
GATEWAY_FAULTS = (401, 403, 502, 503, 504)
JSON_OPEN, JSON_CLOSE = (b"{", b"["), (b"}", b"]")
WATCH_AFTER_S = 0.05


def _require_stream(resp: Response) -> None:
    if not (resp.content_type or b"").startswith(SSE):
        raise errors.upstream_failed("it answered a streaming request without a stream")


def _whole_headers(resp: Response, data: bytes) -> list[tuple[bytes, bytes]]:
    """A whole (non-streamed) answer's headers: its length is known, so it goes with `content-length`,
    never chunked (which an HTTP/1.0 client cannot read)."""
    return [(b"content-type", resp.content_type or b"application/json"), (b"content-length", b"%d" % len(data))]


def _prepared(out: bytes, splice: Splice | None, meter: Meter | None) -> bytes:
    """A stream's whole events as relayed: a continuation's rewritten as the first answer's (gateway/resume.py),
    an accounted request's usage taken (and dropped where the gateway asked for it); what a stream relays is
    counted, so that one left early is charged (Quotas.settle)."""
    if splice is not None and splice.legs > 1 and out:
        out = splice.rewrite(out)
    if meter is not None:
        if USAGE in out:
            out = meter.events(out)
        meter.relayed += out.count(b"data: {")
    return out


def _fed(frames: "SSEFrames | NativeFrames", chunk: bytes, splice: Splice | None, meter: Meter | None) -> bytes:
    """The complete events `chunk` completes, prepared for relaying: a chat stream's by `_prepared`, an
    Anthropic stream passed through (gateway/messages_native.py) counted from its own usage events."""
    if isinstance(frames, SSEFrames):
        return _prepared(frames.feed(chunk), splice, meter)
    out = frames.feed(chunk)
    if meter is not None:
        meter.relayed = frames.deltas
        if frames.counts is not None:
            meter.counts = frames.counts
    return out


def _start(status: int, headers: list[tuple[bytes, bytes]], x: "_Exchange") -> dict:
    """The response's start message; an accounted answer's rate-limit headers go as the safe lines of
    llmgw/http/response_head.py where the server takes them (every llmgw listener), else in the list."""
    m = x.meter
    if m is None:
        return {"type": "http.response.start", "status": status, "headers": headers}
    if m.lines:
        return {"type": "http.response.start", "status": status, "headers": headers, HEAD: m.head}
    return {"type": "http.response.start", "status": status, "headers": headers + m.headers}


def _media_setting(route: ModelRoute) -> object:
    return route.model.limits.media_urls if route.model.limits is not None else "refuse"


def looks_like_json(data: bytes) -> bool:
    """A JSON object or array from its first to its last byte (a cheap check: an answer cut short, an
    event stream or an HTML page fails it; the engine's JSON itself is the client's to read)."""
    if data[:1] in JSON_OPEN and data[-1:] in JSON_CLOSE:
        return True
    return data[:64].lstrip()[:1] in JSON_OPEN and data[-64:].rstrip()[-1:] in JSON_CLOSE


RETRY_AFTER_MAX_S = 300  # an engine's Retry-After passed on at most this long (a client may sleep on it)


def _carry_retry_after(err: APIError, headers: list[tuple[bytes, bytes]]) -> None:
    """Pass an engine's Retry-After in seconds on to the client, at most `RETRY_AFTER_MAX_S`; any other form
    (an HTTP date, garbage) leaves the gateway's own value."""
    for name, value in headers:
        if name.lower() == b"retry-after":
            if value.isdigit() and len(value) <= 12:
                err.headers = {**(err.headers or {}), "Retry-After": str(max(1, min(int(value), RETRY_AFTER_MAX_S)))}
            return


class _Exchange:
    """One client request's state, shared with its disconnect watcher.

    The watcher is a task waiting on ASGI `receive()` for `http.disconnect`, which then cancels the
    request's task. Measured (bench/relays.py), starting one per request costs about a fifth of the relay's
    CPU; so it starts only once a request has lasted `WATCH_AFTER_S`: a request that ends sooner has
    nothing worth cancelling, and a client that leaves a longer one is noticed within that delay.
    """

    __slots__ = ("task", "receive", "timer", "watcher", "started", "finished", "gone", "held", "meter", "door", "tr",
                 "label", "batch")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.receive: Receive | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.watcher: asyncio.Task | None = None
        self.started = False  # the response has begun: errors can no longer change its status
        self.finished = False  # the last byte is being sent: a disconnect now is the normal end
        self.gone = False  # the client went away first
        self.held = False  # a streaming request held for a load: its 200 and SSE headers are already sent
        self.meter: Meter | None = None  # an accounted request's usage and rate-limit headers
        self.door: Door | None = None  # another API's request, served as a chat (gateway/messages.py, responses.py)
        self.tr: Any = None  # its stream translator, for a streaming one
        self.label = "unknown"
        self.batch = False  # a request of a batch (gateway/batches.py): the batch band, usage counted by the batch

    def error_body(self, err: APIError) -> bytes | None:
        return self.door.error_body(err) if self.door is not None else None

    @property
    def native(self) -> bool:
        """A Messages request the replica serving it answers in Messages itself (gateway/messages_native.py)."""
        return isinstance(self.door, MessagesDoor) and self.door.native

    def stream_error(self, err: APIError) -> bytes:
        """The event that ends a stream the gateway failed: in the door's API, or OpenAI's and `[DONE]`."""
        return self.tr.error(err) if self.tr is not None else sse_error(err) + DONE

    def out(self, data: bytes) -> bytes:
        """Events as the client's API has them: translated for a door's stream, else as they are."""
        return self.tr.feed(data) if self.tr is not None else data

    def watch(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.receive = receive
        self.timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start_watcher)

    def _start_watcher(self) -> None:
        self.timer = None
        if not self.finished:
            self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        assert self.receive is not None
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if not self.finished and self.task is not None:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()


class _Leg:
    """The engine answer a request reads now: its response, its endpoint (counted outstanding until booked),
    the model serving it, every replica it was sent to, and the LoRA adapter it asks for (a continuation
    asks for it too). A continued stream moves it to another engine."""

    __slots__ = ("resp", "ep", "name", "tried", "adapter")

    def __init__(self, resp: Response, ep: Endpoint | None, name: str, tried: set[str],
                 adapter: Adapter | None = None):
        self.resp = resp
        self.ep = ep
        self.name = name
        self.tried = tried
        self.adapter = adapter


class Proxy:
    """The ASGI handler for POST /v1/chat/completions, /v1/completions and /v1/embeddings."""

    def __init__(self, routes: RouteTable, demand: Demand, gates: Gates, balancer: Balancer, upstream: Upstream,
                 metrics: GatewayMetrics, max_body: int = MAX_BODY, quotas: Quotas | None = None,
                 isolation: Isolation | None = None, adapters: AdapterLoads | None = None):
        self.routes = routes
        self.adapters = adapters or AdapterLoads(None, upstream)
        self.isolation = isolation
        self.quotas = quotas
        self.demand = demand
        self.gates = gates
        self.balancer = balancer
        self.upstream = upstream
        self.metrics = metrics
        self.max_body = max_body
        self.guard = Guard(self.call)
        self.dialects = Dialects(upstream)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        await self.handle(scope, receive, send, None)

    async def handle(self, scope: dict, receive: Receive, send: Send, account: Account | None,
                     door: Door | None = None, batch: bool = False) -> None:
        """One request; `account` when its key is accounted (KeyRing.lookup), else None. `door`: a request of
        another API (Anthropic's Messages, OpenAI's Responses), translated to a chat completion as it comes
        in and back as it goes out; everything between is a chat's path. `batch`: a request of a batch
        (gateway/batches.py): it waits in the `batch` band of a saturated model, behind interactive
        traffic; its key's models still apply, and its usage is counted by the batch, in the transaction
        that records its answer (db/batches_repo.py), not here, so that a request a restart sends again
        is counted once."""
        started = time.perf_counter()
        label = "unknown"  # never a client-chosen string: label cardinality stays bounded
        status = 0
        ttft = None
        x = _Exchange()
        counted = False
        HELD_FOR.set(None)
        try:
            path = scope["path"]
            x.door = door
            x.batch = batch
            req_body = await read_body(receive, self.max_body)
            if door is not None:
                path, req_body = CHAT, json.dumps(door.request(req_body)).encode()
            req = parse_request(path, req_body)
            if door is not None and req.get("stream") is True:
                x.tr = door.stream()
            route, adapter = self._resolve(req["model"])
            if route is None:
                route = await self.routes.lookup(req["model"])  # (no await when known)
            if route is None:
                usable = (lambda m: account.refusing(m) is None) if account is not None else None
                raise errors.model_not_found(req["model"], self.routes.similar(req["model"], usable))
            if adapter is not None and not adapter.allows(account.tenant if account is not None else None):
                raise errors.adapter_not_allowed(adapter.name, account.tenant if account is not None else None)
            label = x.label = adapter.name if adapter is not None else route.model.name
            chars = prompt_chars(path, req)
            if chars > route.bound.chars:  # before it is queued, counted or loads a model
                raise errors.prompt_too_long(label, chars, route.bound, prompt_param(path, req))
            if route.text_only and path == CHAT and (part := media_part(req)) is not None:
                raise errors.text_only(label, part)
            if path != COMPLETIONS and has_parts(req) and (urls := list(media_urls(req))):  # (embeddings too)
                await check_media(label, route.model.limits, urls)
            iso = self.isolation.of(account, req) if self.isolation is not None and path != EMBEDDINGS else None
            if batch and account is not None and (refusing := account.refusing(route.model)) is not None:
                raise errors.model_not_allowed(route.model.name, refusing.who, refusing.limits.models or [])
            if account is not None and self.quotas is not None and not batch:
                x.meter, req, req_body = self.quotas.admit(account, route.model, req, req_body, chars, route.output,
                                                           adapter.name if adapter is not None else None)
                x.meter.lines = HEAD in (scope.get("extensions") or ())
            self.metrics.begin(label)
            counted = True
            x.watch(receive)
            status, ttft = await self._serve(route, path, req, req_body, send, x, started, chars, iso, adapter)
        except APIError as err:
            status = err.status
            if not x.started:  # an accounted request's answer carries its rate-limit headers, errors too
                await send_error(send, err, x.meter.headers if x.meter is not None else None, x.error_body(err))
            elif x.held and not x.finished:  # held while loading: the stream ends with the error event
                x.finished = True  # and `[DONE]`, as every stream does (gateway/sse.py)
                await send({"type": "http.response.body", "body": x.stream_error(err), "more_body": False})
        except asyncio.CancelledError:
            if not x.gone:
                raise
            status = 499
            if x.task is not None:
                x.task.uncancel()
        except ConnectionResetError:
            status = 499
        except Exception:  # noqa: BLE001 - a bug: log it, answer in the envelope, never a traceback
            log.exception("unexpected error relaying %s", scope.get("path"))
            status = 500
            if not x.started:
                await send_error(send, errors.internal(), body=x.error_body(errors.internal()))
        finally:
            x.stop()
            if x.meter is not None:
                self.quotas.settle(x.meter)  # type: ignore[union-attr]
            if counted:
                self.metrics.end(label)
            self.metrics.observe(label, status, time.perf_counter() - started, ttft)
            if (rung := HELD_FOR.get()) is not None and status == 200:
                self.metrics.activated(label, rung, ttft if ttft is not None else time.perf_counter() - started)
            if ttft is not None and account is not None:
                self.metrics.tenant_ttft(account.label, ttft)

    async def count_tokens(self, receive: Receive, send: Send, account: Account | None) -> None:
        """Anthropic's POST /v1/messages/count_tokens: `{"input_tokens": N}`, the gateway's own estimate (a
        token for every 4 characters of the prompt's text as the model renders it, the count budgets reserve
        by), after the checks a Messages request gets before any engine: the model is known, its key may use
        it, the prompt is within its bound. No engine is asked, and nothing is counted against a budget."""
        try:
            chat = messages.to_chat(messages.decode_request(await read_body(receive, self.max_body)), count_only=True)
            route, adapter = self._resolve(chat["model"])
            route = route or await self.routes.lookup(chat["model"])
            if route is None:
                usable = (lambda m: account.refusing(m) is None) if account is not None else None
                raise errors.model_not_found(chat["model"], self.routes.similar(chat["model"], usable))
            refusing = account.refusing(route.model) if account is not None else None
            if refusing is not None:
                raise errors.model_not_allowed(route.model.name, refusing.who, refusing.limits.models or [])
            if adapter is not None and not adapter.allows(account.tenant if account is not None else None):
                raise errors.adapter_not_allowed(adapter.name, account.tenant if account is not None else None)
            chars = prompt_chars(CHAT, chat)
            if chars > route.bound.chars:
                raise errors.prompt_too_long(route.model.name, chars, route.bound, prompt_param(CHAT, chat))
            body = json.dumps({"input_tokens": max(1, -(-chars // CHARS_PER_TOKEN))}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})
        except APIError as err:
            await send_error(send, err, body=messages.error_body(err))
        except ConnectionResetError:
            pass

    def _resolve(self, name: object) -> tuple[ModelRoute | None, Adapter | None]:
        """The route a request's `model` names, and the LoRA adapter when it names one (its base's route)."""
        route = self.routes.resolve(name)  # type: ignore[arg-type]
        if route is not None or not self.routes.adapters:
            return route, None
        found = self.routes.adapter(name)  # type: ignore[arg-type]
        return found if found is not None else (None, None)

    # ---- one request -----------------------------------------------------------------------------
    async def _serve(self, route: ModelRoute, path: str, req: dict, body: bytes, send: Send, x: _Exchange,
                     started: float, chars: int = 0, iso: Isolated | None = None,
                     adapter: Adapter | None = None) -> tuple[int, float | None]:
        policy = route.model.guard if path in GUARDED else None
        if policy is not None:
            convo = conversation(path, req)  # 400 for a prompt its guard cannot read (token ids)
            if "request" in policy.check:
                if x.meter is not None:
                    x.meter.sent = True  # the judge reads the prompt: charged, even if it is refused
                await self._judge(route.model.name, policy, "request", convo,
                                  "messages" if path.endswith("chat/completions") else "prompt", iso)

        judged = policy is not None and "response" in policy.check
        door = x.door if isinstance(x.door, MessagesDoor) else None
        if door is not None:
            door.may_pass = not judged  # a judged answer is read as a chat's: translated

        async def consume(leg: _Leg) -> tuple[int, float | None]:
            if judged:
                return await self._send_judged(leg.resp, route.model.name, policy, path, req, send, x, iso), None
            if req.get("stream") is not True:
                return await self._relay_whole(leg.resp, send, x)
            return await self._relay_stream(leg, path, req, send, x, started, iso)

        held_as = adapter.name if adapter is not None else route.model.name
        hold = self._holder(held_as, send, x) if req.get("stream") is True and not judged else None
        return await self._exchange(route, path, req, body, consume, hold, x.meter, chars, iso, adapter, x.batch,
                                    door)

    @staticmethod
    def _holder(name: str, send: Send, x: _Exchange) -> Hold:
        """While a streaming request waits for `name` to load: send 200 with SSE headers once, then a comment
        line each time (`: loading NAME, 12 s`), so proxies and clients see a live stream (issue 13)."""
        async def hold(waited_s: float) -> None:
            if not x.started:
                x.started = x.held = True
                await send(_start(200, STREAM_HEADERS, x))
            await send({"type": "http.response.body", "body": f": loading {name}, {waited_s:.0f} s\n\n".encode(),
                        "more_body": True})
        return hold

    def _plan(self, route: ModelRoute, path: str, req: dict, chars: int, meter: Meter | None = None,
              adapter: Adapter | None = None) -> list[ModelRoute]:
        """The models to try in order: the asked one if it has endpoints, then its fallbacks that do, that
        the request's key may use (`models` of its tenant or key) and that take the request as the asked
        one did (its prompt bound, text only): a fallback had served what it refuses when asked directly.
        An adapter's request has no fallbacks (another model holds no such adapter)."""
        if route.endpoints and (adapter is not None or not route.model.fallbacks):
            return [route]
        if adapter is not None:
            self.demand.ask(route)
            return []
        if not route.endpoints:
            self.demand.ask(route)  # load it for next time even while a fallback serves
        fallbacks = [r for r in self.routes.fallbacks(route) if r.endpoints and chars <= r.bound.chars
                     and not (r.text_only and path == CHAT and media_part(req) is not None)]
        if fallbacks and path != COMPLETIONS and has_parts(req) and next(media_urls(req), None) is not None:
            # Media URLs the asked model allows: only a fallback with the same `limits.media_urls` takes them.
            allowed = _media_setting(route)
            fallbacks = [r for r in fallbacks if _media_setting(r) == allowed]
        if meter is not None:
            fallbacks = [r for r in fallbacks if meter.account.refusing(r.model) is None]
        return [r for r in (route, *fallbacks) if r.endpoints]

    async def _exchange(self, route: ModelRoute, path: str, req: dict, body: bytes,
                        consume: Callable[["_Leg"], Awaitable[Any]], hold: Hold | None = None,
                        meter: Meter | None = None, chars: int = 0, iso: Isolated | None = None,
                        adapter: Adapter | None = None, batch: bool = False,
                        door: MessagesDoor | None = None) -> Any:
        """Route, admit, open the upstream answer and hand it to `consume`; keeps the books (outstanding
        requests, breaker, use for the idle clock, the concurrency slot) whatever happens. With no Ready
        replica the request is held for a load (`hold` is called while it waits). A fallback that serves
        takes a slot under its own limits (or is passed over when it has none free) and its own use. An
        adapter's request is held for its base as the base's would be, and counts as the base's use."""
        plan = self._plan(route, path, req, chars, meter, adapter)
        if not plan:
            plan = [await self.demand.wait(route, hold)]
        name = plan[0].model.name
        gate = self.gates.get(name)
        if gate is not None and not gate.try_acquire():  # saturated: wait in its tenant's queue (fairness.py)
            share = (share_of(meter.account, meter.held) if meter is not None
                     else share_of(None, request_cost(req, chars, plan[0].output)))
            if batch:
                share.band = BATCH
            await gate.acquire(share)
        usage = self.demand.usage
        usage.begin(name)
        # The fallback serving, once `_open` has taken its slot: (name, the gate it took the slot of). The slot
        # goes back to that gate object: a catalog refresh in between may have put a new gate under the name,
        # whose `active` a release would take below 0 (issue 36).
        fallback: list[tuple[str, Gate | None]] = []
        try:
            tried: set[str] = set()
            resp, ep, served = await self._open(plan, path, req, body, meter, fallback, iso, tried, adapter, hold,
                                                door)
            leg = _Leg(resp, ep, served.model.name, tried, adapter)
            healthy: bool | None = None
            try:
                result = await consume(leg)
                healthy = True
                return result
            except APIError as err:
                healthy = None if err.code == "answer_too_large" else err.status not in (502, 504)
                raise
            finally:
                if leg.ep is not None:  # (None: a stream that moved off it and found no other, gateway/resume.py)
                    self._done(leg.ep, healthy)
                    leg.resp.release()
        finally:
            usage.end(name)
            if gate is not None:
                gate.release()
            for other, g in fallback:
                usage.end(other)
                if g is not None:
                    g.release()

    def _take_fallback(self, name: str, taken: list[tuple[str, Gate | None]]) -> bool:
        """Move the request to fallback `name`: a free slot under its limits (no waiting: the request
        already waited once), and its use for the idle clock. False when it has no free slot. `taken` holds
        the fallback serving and the gate object its slot came from (released on that same object)."""
        gate = self.gates.get(name)
        if gate is not None and not gate.try_acquire():
            return False
        for other, g in taken:  # the previous fallback, which could not answer
            self.demand.usage.end(other)
            if g is not None:
                g.release()
        taken[:] = [(name, gate)]
        self.demand.usage.begin(name)
        return True

    @staticmethod
    def _prefix_key(mr: ModelRoute, path: str, req: dict, iso: Isolated | None) -> int | None:
        """The request's prefix key for `balancing: prefix` (gateway/prefix.py), within the salt its engine
        keys its cache by: its tenant's (gateway/isolation.py), else the client's own; None for embeddings."""
        if path == EMBEDDINGS:
            return None
        if iso is not None and iso.salt is not None and mr.model.cache_isolation == "tenant":
            salt = iso.salt
        else:
            salt = req.get("cache_salt")
        return prefix_key(path, req, salt if isinstance(salt, str) else None, mr.model.name)

    def _done(self, ep: Endpoint, healthy: bool | None) -> None:
        ep.outstanding -= 1
        if healthy is True:
            self.balancer.succeeded(ep)
        elif healthy is False:
            self.balancer.failed(ep, asyncio.get_running_loop().time())
        else:
            ep.trial = False  # cancelled: no verdict on the endpoint

    async def _open(self, plan: list[ModelRoute], path: str, req: dict, body: bytes,
                    meter: Meter | None = None, fallback: list[tuple[str, Gate | None]] | None = None,
                    iso: Isolated | None = None, tried: set[str] | None = None,
                    adapter: Adapter | None = None, hold: Hold | None = None,
                    door: MessagesDoor | None = None) -> tuple[Response, Endpoint, ModelRoute]:
        """Send the request to the best endpoint, moving on to the next while nothing has reached the
        client. Returns an answer with a status below 400, its endpoint counted as outstanding, and the
        model route it came from; `tried` collects the replicas it was sent to (those in it are passed
        over: a stream's continuation, gateway/resume.py). An
        accounted request's `meter.sent` says whether an engine has it (so a client that leaves before the
        answer is still charged its prompt): set as it is sent, cleared when no engine took it. `iso`: what
        its endpoints are told for cache isolation (gateway/isolation.py), by model and engine. `adapter`: the
        LoRA adapter the request names, sent to a replica holding it, loaded into one first when none does
        (gateway/adapters.py; `hold` is called while it loads, as while a model loads). `door`: a Messages
        request, sent as it came to a replica that speaks Messages (`door.may_pass`, gateway/dialects.py),
        translated to the others; `door.native` says which the answer returned is."""
        loop = asyncio.get_running_loop()
        tried = set() if tried is None else tried
        last: APIError | None = None
        reloaded = False  # an adapter's replica answered 404 once (it had lost it) and was asked again
        for i, mr in enumerate(plan):
            name = mr.model.name
            if i and fallback is not None and name != plan[0].model.name and not self._take_fallback(name, fallback):
                last = errors.overloaded(name)
                continue
            sent_name = adapter.name if adapter is not None else name
            data = body if req["model"] == sent_name else json.dumps({**req, "model": sent_name}).encode()
            key = self._prefix_key(mr, path, req, iso) if mr.model.balancing == "prefix" else None
            while True:
                candidates = mr.endpoints
                if adapter is not None:
                    candidates = self.adapters.holders(mr.endpoints, adapter.name, tried) or mr.endpoints
                ep = self.balancer.pick(candidates, tried, loop.time(), key)
                if ep is None:
                    break
                if adapter is not None:
                    try:
                        await self.adapters.ensure(ep, name, adapter, hold)
                    except APIError as err:
                        log.warning("%s: %s; trying another", ep.replica_id, err.message)
                        tried.add(ep.replica_id)
                        last = err
                        continue
                    self.adapters.used(ep, adapter.name)
                if tracing_enabled() and self.balancer.last is not None:
                    c = self.balancer.last
                    trace_route(name, ep.replica_id, c.policy, c.reason(), len(tried))
                sent_path, native = path, False
                if door is not None:
                    native = door.may_pass and await self.dialects.native(ep)
                    door.passing(native)
                if native:
                    assert door is not None
                    sent_path = messages_native.PATH
                    asked = messages_native.request(door.original, sent_name, req)
                    sent = json.dumps(asked).encode()
                else:
                    asked, sent = req if data is body else {**req, "model": sent_name}, data
                if ep.engine == "llamacpp" and (adapter is not None or ep.adapter_files or "lora" in asked):
                    asked = {**asked, "lora": lora_field(ep, adapter)}  # (its own `lora` is never passed on)
                    sent = json.dumps(asked).encode()
                sent = sent if iso is None else iso.body(mr.model, ep.kind, asked, sent)
                if tried:
                    self.metrics.retries.labels(plan[0].model.name).inc()
                tried.add(ep.replica_id)
                ep.outstanding += 1
                if meter is not None:
                    meter.sent = True
                try:
                    resp = await self.upstream.post(ep.target, sent_path, sent)
                except ConnectFailed as exc:
                    if meter is not None:
                        meter.sent = False
                    self._done(ep, False)
                    log.warning("%s at %s failed before answering (%s); trying another", ep.replica_id, ep.url, exc)
                    last = errors.upstream_failed(str(exc))
                    continue
                except UpstreamTimeout:
                    self._done(ep, False)
                    raise errors.upstream_timeout(self.upstream.read_timeout_s) from None
                except UpstreamBroken as exc:
                    self._done(ep, False)
                    raise errors.upstream_failed(str(exc)) from None
                except BaseException:
                    self._done(ep, None)
                    raise
                status = resp.status
                if status < 400:
                    return resp, ep, mr
                if meter is not None:
                    meter.sent = False  # the engine refused it: nothing to charge
                try:
                    err = engine_error(status, await resp.read(64 << 10))
                except UpstreamError as exc:
                    err = errors.upstream_failed(str(exc))
                except BaseException:
                    resp.abort()
                    self._done(ep, None)
                    raise
                if status in (429, 503):
                    _carry_retry_after(err, resp.headers)
                resp.release()  # (resets the response for the connection's next use)
                # Only a gateway failure (502, 503, 504, an engine refusing the gateway's key: 401, 403; a
                # refused connection or a timeout above) counts against the endpoint: a 500 or 501 may be the
                # engine's answer to a malformed request, and counting it would let any client open the
                # breaker of a model for everyone. A busy engine (429) is neither: another replica may not be.
                self._done(ep, False if status in GATEWAY_FAULTS else True if status < 500 and status != 429
                           else None)
                if adapter is not None and status == 404 and not reloaded:  # it lost the adapter: load it again
                    log.warning("%s answered 404 for adapter %s; loading it again", ep.replica_id, adapter.name)
                    self.adapters.forget(ep, adapter.name)
                    tried.discard(ep.replica_id)
                    reloaded = True
                    continue
                if status not in RETRYABLE:
                    raise err
                log.warning("%s at %s answered HTTP %d before anything was relayed; trying another",
                            ep.replica_id, ep.url, status)
                last = err
        if last is not None:
            raise last
        waits = [w for w in (self.balancer.reopens_in(mr.endpoints, loop.time()) for mr in plan) if w is not None]
        raise errors.circuit_open(plan[0].model.name, max(1, math.ceil(min(waits, default=1.0))))

    async def _relay_whole(self, resp: Response, send: Send, x: _Exchange) -> tuple[int, None]:
        """A non-streaming answer: one JSON body, read whole before its status is sent (gateway/sse.py has
        the streaming contract)."""
        data = await self._read_whole(resp, stream=False)
        if x.meter is not None and x.native:
            x.meter.whole = True
            x.meter.counts = messages_native.counts_of_message(data) or x.meter.counts
        elif x.meter is not None:
            x.meter.body(data)
        if x.door is not None:
            data = x.door.answer(data)
        x.started = x.finished = True
        await send(_start(resp.status, _whole_headers(resp, data), x))
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return resp.status, None

    async def _relay_stream(self, leg: "_Leg", path: str, req: dict, send: Send, x: _Exchange, started: float,
                            iso: Isolated | None = None) -> tuple[int, float | None]:
        """Relay a stream as the client-facing contract says (gateway/sse.py): well-formed events as they
        complete, one `[DONE]`. An engine that dies or stalls before `[DONE]` has its stream continued on
        another replica of the model where the model's `routing.stream_resume` allows and the request can be
        continued (gateway/resume.py); else the stream ends with one error event. Returns (status, seconds to
        the first streamed byte)."""
        meter = x.meter
        native = x.native
        splice = None if native else self._splice(leg.name, path, req)
        status = leg.resp.status
        ttft: float | None = None
        itl = self.metrics.itl_of(x.label)  # the gaps between the chunks relayed (inter-token latency)
        while True:  # once per engine serving the stream
            resp = leg.resp
            frames: SSEFrames | NativeFrames = NativeFrames() if native else SSEFrames()
            out = b""
            try:
                _require_stream(resp)
                chunk = await resp.next_chunk()
                if not x.started:  # (a request held through a load has had its 200: Proxy._holder)
                    x.started = True
                    await send(_start(resp.status, STREAM_HEADERS, x))
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - started
                if splice is not None:  # stalls count from the first byte: a long prefill is no stall
                    resp.limit(min(splice.stall_s, self.upstream.read_timeout_s))  # never past the read timeout
                while chunk and not resp.complete:  # the last chunk goes with the end of the body: one write
                    out = _fed(frames, chunk, splice, meter)
                    if frames.done:  # its [DONE]: the answer ends here, whatever the engine sends after (or keeps
                        break        # open); the connection is dropped, not pooled (Response.release)
                    if out:
                        await send({"type": "http.response.body", "body": x.out(out), "more_body": True})
                        if splice is not None:
                            splice.keep(out)
                    chunk = await self._next_chunk(leg, splice)
                    last, now = now, time.perf_counter()
                    itl.observe(now - last)
                else:
                    out = _fed(frames, chunk, splice, meter)  # the last events too (not [DONE])
            except (APIError, UpstreamError, StreamBroken) as exc:
                if isinstance(exc, APIError):
                    err = exc
                elif isinstance(exc, UpstreamTimeout):
                    err = errors.upstream_timeout(resp.timeout_s or self.upstream.read_timeout_s)
                else:
                    err = errors.upstream_failed(str(exc))
                resp.abort()
                if splice is not None and not frames.done and not isinstance(exc, APIError):
                    how = await self._resume(leg, splice, path, iso, meter, exc)
                    if how == "resumed":
                        continue
                    if how == "whole":  # it had said all but its end
                        x.finished = True
                        await send({"type": "http.response.body", "body": x.out(frames.broken(b"")), "more_body": False})
                        return status, ttft
                if not x.started:  # nothing reached the client: an error status
                    raise err from None
                x.finished = True
                tail = frames.broken(sse_error(err))
                await send({"type": "http.response.body", "body": x.out(tail), "more_body": False})
                if not tail:  # it had said [DONE]: what came after is not the client's concern
                    return status, ttft
                log.warning("the engine broke off an answer mid-way: %s", exc)
                raise err from None
            x.finished = True
            tail = frames.finish(_MID_EVENT)
            await send({"type": "http.response.body", "body": x.out(out + tail), "more_body": False})
            if tail not in (b"", DONE):  # (an error event: the stream ended mid-event, or short of its end)
                log.warning("the engine's stream ended mid-event")
                raise errors.upstream_failed("its stream ended mid-event")
            return status, ttft

    def _splice(self, name: str, path: str, req: dict) -> Splice | None:
        """A stream's `Splice` when its model's `routing.stream_resume` and the request allow continuing it."""
        route = self.routes.resolve(name)
        if route is None or path == EMBEDDINGS:
            return None
        setting = route.model.stream_resume
        if setting.attempts <= 0 or refusal(path, req) is not None:
            return None
        return Splice(path, req, setting.attempts, setting.stall_s)

    async def _next_chunk(self, leg: "_Leg", splice: Splice | None) -> bytes:
        """The stream's next chunk. A stall (`UpstreamTimeout` after `stall_s`) is raised only when the stream
        can move to another replica; else it waits on, up to the upstream's read timeout."""
        resp = leg.resp
        try:
            return await resp.next_chunk()
        except UpstreamTimeout:
            if splice is None or resp.timeout_s is None:
                raise
            splice.fold()
            if splice.why_not() is None and self._continuers(leg, splice):
                raise
            waited = resp.timeout_s
            log.info("%s stalled %gs mid-stream and the stream cannot move (%s): waiting on", leg.ep.replica_id
                     if leg.ep else "?", waited, splice.why_not() or "no other replica")
            resp.limit(max(0.001, self.upstream.read_timeout_s - waited))
            try:
                return await resp.next_chunk()
            finally:
                resp.limit(None)  # this engine's stream is no longer watched for stalls

    def _continuers(self, leg: "_Leg", splice: Splice) -> ModelRoute | None:
        """The model's route narrowed to the replicas that may continue `splice`: not tried yet, usable, and
        for a chat able to continue a final message. None when there is none."""
        route = self.routes.resolve(leg.name)
        if route is None:
            return None
        now = asyncio.get_running_loop().time()
        eps = [ep for ep in route.endpoints if ep.replica_id not in leg.tried and self.balancer.usable(ep, now)
               and (ep.continues_chat or not splice.chat)]
        return dataclasses.replace(route, endpoints=eps) if eps else None

    async def _resume(self, leg: "_Leg", splice: Splice, path: str, iso: Isolated | None, meter: Meter | None,
                      exc: Exception) -> str:
        """Move a broken stream to another replica: `resumed` (leg is the new engine's answer), `whole` (the
        answer had been given but for its end) or `failed` (the caller ends the stream with an error event).
        The engine that broke off is booked as any failed upstream: its breaker counts it, and it is logged."""
        dead = leg.ep
        assert dead is not None
        label = leg.adapter.name if leg.adapter is not None else leg.name  # (as the request's metrics)
        what = "stalled" if isinstance(exc, UpstreamTimeout) else "broke off"
        leg.ep = None  # booked here, not again by _exchange
        self._done(dead, False)
        splice.fold()
        why = splice.why_not()
        if splice.finished:
            log.warning("%s at %s %s a stream after its last token (%s); ending it", dead.replica_id, dead.url,
                        what, exc)
            return "whole"
        body = splice.request() if why is None else None
        if why is None and body is None:
            log.warning("%s at %s %s a stream at its length cap (%s); ending it", dead.replica_id, dead.url, what, exc)
            return "whole"
        route = self._continuers(leg, splice) if why is None else None
        if why is None and route is None:
            why = "no other replica can continue it"
        if why is not None:
            log.warning("%s at %s %s a stream mid-answer (%s); not continued: %s", dead.replica_id, dead.url, what,
                        exc, why)
            self.metrics.stream_resumes.labels(label, "failed").inc()
            return "failed"
        assert route is not None and body is not None
        splice.attempts -= 1
        log.warning("%s at %s %s a stream mid-answer (%s); continuing it on another replica after %d event(s)",
                    dead.replica_id, dead.url, what, exc, splice.events)
        try:
            resp, ep, _ = await self._open([route], path, body, json.dumps(body).encode(), meter, None, iso, leg.tried,
                                           leg.adapter)
        except APIError as err:
            log.warning("the continuation of a stream of %s found no replica: %s", label, err.message)
            self.metrics.stream_resumes.labels(label, "failed").inc()
            return "failed"
        leg.resp, leg.ep = resp, ep
        splice.legs += 1
        self.metrics.stream_resumes.labels(label, "resumed").inc()
        return "resumed"

    async def _send_judged(self, resp: Response, label: str, policy: GuardPolicy, path: str, req: dict,
                           send: Send, x: _Exchange, iso: Isolated | None = None) -> int:
        """Hold the whole answer, have the guard judge it, then send it (or the refusal), under the same
        contract as `_relay`."""
        stream = req.get("stream") is True
        data = await self._read_whole(resp, stream, MAX_HELD)
        if stream:
            frames = SSEFrames()
            data = frames.feed(data)
            data += frames.finish(_MID_EVENT)
            if x.meter is not None:
                data = x.meter.events(data)
                x.meter.relayed = data.count(b"data: {")
        elif x.meter is not None:
            x.meter.body(data)
        messages = conversation(path, req) + [{"role": "assistant", "content": answer_text(data, stream)}]
        await self._judge(label, policy, "response", messages, None, iso)
        if x.tr is not None:
            data = x.tr.feed(data)
        elif x.door is not None:
            data = x.door.answer(data)
        x.started = x.finished = True
        await send(_start(resp.status, STREAM_HEADERS if stream else _whole_headers(resp, data), x))
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return resp.status

    async def _read_whole(self, resp: Response, stream: bool, limit: int = MAX_ANSWER) -> bytes:
        """A whole answer (up to `limit` bytes) in the form the request asked for: one JSON body, or an
        event stream; engine failures as OpenAI errors (504/502), so a body cut short is never a 200."""
        if stream:
            _require_stream(resp)
        elif (resp.content_type or b"").startswith(SSE):
            raise errors.upstream_failed("it streamed an answer to a request that did not ask for a stream")
        try:
            data = await resp.read_whole(limit)
        except UpstreamTimeout:
            raise errors.upstream_timeout(self.upstream.read_timeout_s) from None
        except AnswerTooLarge:
            raise errors.answer_too_large(limit) from None
        except UpstreamBroken as exc:
            raise errors.upstream_failed(str(exc)) from None
        if not stream and not looks_like_json(data):
            log.warning("the engine's answer is not one JSON body: %s", printable(data, 300))
            raise errors.upstream_failed("its answer is not one JSON body")
        return data

    async def _judge(self, label: str, policy: GuardPolicy, stage: str, messages: list[dict], param: str | None,
                     iso: Isolated | None = None) -> None:
        """`iso`: the request's own isolation, so the judge reads the tenant's prompt under the tenant's salt
        (a judge's prefix cache shared across tenants would leak prompts through its timing)."""
        try:
            await self.guard.judge(policy, stage, messages, param, iso)
        except APIError as err:
            if err.code == "content_filter":
                self.metrics.guard_refusals.labels(label, stage).inc()
            raise

    # ---- requests the gateway makes itself (the guard's judge) ------------------------------------
    async def call(self, model: str, path: str, payload: dict, iso: Isolated | None = None) -> tuple[int, Any]:
        """POST `payload` to `model` like a client request (routing, load on demand, limits, breaker).
        Returns (status, decoded JSON or None). Raises `APIError` when it cannot be served."""
        route = await self.routes.lookup(model)
        if route is None:
            raise errors.model_not_found(model, self.routes.similar(model))
        chars = prompt_chars(path, payload)
        if chars > route.bound.chars:  # 400 as a request to it would get, not a retryable 503 after it refused
            raise errors.prompt_too_long(route.model.name, chars, route.bound, prompt_param(path, payload))
        if route.text_only and path == CHAT and (part := media_part(payload)) is not None:
            raise errors.text_only(route.model.name, part)

        async def consume(leg: _Leg) -> tuple[int, Any]:
            resp = leg.resp
            data = await self._read_whole(resp, stream=False, limit=MAX_HELD)
            try:
                return resp.status, json.loads(data)
            except (ValueError, UnicodeDecodeError):
                return resp.status, None

        payload = {**payload, "model": route.model.name}
        return await self._exchange(route, path, payload, json.dumps(payload).encode(), consume, iso=iso)
