"""A gateway that drains: on SIGTERM no request is cut without a word (issue 38).

`Drain` stands around the gateway's `/v1/` requests (gateway/app.py). While it runs it counts each open
request (its task, and how far its answer got). `drain()` (called by `llmgw server` when SIGTERM or
SIGINT arrives, before its listeners close):
1. stops accepting: every new `/v1/` request is answered 503 `gateway_draining` with `Retry-After` and
   `Connection: close`, and `GET /readyz` answers 503 `{"status": "draining"}`, so a load balancer stops
   sending here (`GET /healthz`, liveness, stays 200: the process is alive and finishing its work);
2. answers the requests held for a model to load at once (503 + Retry-After, or for a held stream its
   error event and `[DONE]`; gateway/demand.py), since the load they wait for may take minutes;
3. lets every other open answer and stream finish, up to `gateway_drain_timeout_s`;
4. then ends what is still open: a stream gets one error event and `data: [DONE]` (never a stream cut
   without an error event), an answer not yet begun a 503 with Retry-After. Its upstream connection is
   dropped, which cancels the engine's work.
Only then does the server close its listeners (uvicorn's graceful shutdown, which would cut whatever is
left after its own timeout, then finds nothing open).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from llmgw.gateway.openai_api import sse_error
from llmgw.gateway.sse import DONE
from llmgw.http import errors
from llmgw.http.errors import send_error

log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]
CLOSE = [(b"connection", b"close")]
CUT_GRACE_S = 2.0  # how long the ended requests get to send their last words once cancelled


class _Open:
    """One open request: how far its answer got, seen through its `send`."""

    __slots__ = ("send", "started", "stream", "done", "cut")

    def __init__(self, send: Send):
        self.send = send
        self.started = False  # its response head was sent
        self.stream = False  # ... as an event stream
        self.done = False  # its last body chunk was sent
        self.cut = False  # the drain ran out and ended it

    def watch(self, message: dict):
        """The request's `send`, seen: a plain function that returns the awaitable of the `send` it wraps, so
        that a streamed answer's events cost no extra coroutine each (response_head.py `HeadCycle.send`)."""
        kind = message["type"]
        if kind == "http.response.body":
            if not message.get("more_body", False):
                self.done = True
        elif kind == "http.response.start":
            self.started = True
            self.stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in message.get("headers", ()))
        return self.send(message)


class Drain:
    """The open `/v1/` requests of one gateway, and its drain (module docstring). `timeout_s`: how long
    open answers may go on after SIGTERM (`gateway_drain_timeout_s`)."""

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.draining = False
        self.started_at: float | None = None
        self.open: dict[asyncio.Task, _Open] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_drain: list[Callable[[], None]] = []  # told when the drain begins (demand: answer held requests)

    def state(self) -> dict:
        """What `/readyz` says: `ready`, or `draining` with the requests still open and the seconds left."""
        if not self.draining:
            return {"status": "ready", "open": len(self.open)}
        left = max(0.0, self.timeout_s - (time.monotonic() - (self.started_at or 0.0)))
        return {"status": "draining", "open": len(self.open), "drain_left_s": round(left, 1)}

    async def __call__(self, handler, scope: dict, receive, send: Send, *args) -> None:
        """Run one request's `handler(scope, receive, send, *args)`, or refuse it while draining."""
        if self.draining:
            await send_error(send, errors.draining(), CLOSE)
            return
        task = asyncio.current_task()
        assert task is not None
        req = _Open(send)
        self.open[task] = req
        self._idle.clear()
        try:
            await handler(scope, receive, req.watch, *args)
        except asyncio.CancelledError:
            if not req.cut:
                raise
            task.uncancel()
            await self._last_words(req)
        finally:
            del self.open[task]
            if not self.open:
                self._idle.set()

    async def _last_words(self, req: _Open) -> None:
        err = errors.drain_timeout(self.timeout_s)
        try:
            if not req.started:
                await send_error(req.send, err, CLOSE)
            elif req.stream and not req.done:
                await req.send({"type": "http.response.body", "body": sse_error(err) + DONE, "more_body": False})
            # an answer begun as one JSON body cannot take an error any more: its connection closes short
        except Exception:  # noqa: BLE001 - the client left meanwhile: nothing to tell
            pass

    async def drain(self) -> int:
        """Stop accepting, wait for open requests up to `timeout_s`, end the rest; returns how many were ended."""
        self.draining = True
        self.started_at = time.monotonic()
        for tell in self.on_drain:
            tell()
        log.info("draining: %d request(s) open, waiting up to %gs for them", len(self.open), self.timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
            log.info("drained: every open request finished")
            return 0
        except asyncio.TimeoutError:
            pass
        left = list(self.open.items())
        log.warning("drain timeout (%gs): ending %d open request(s), each stream with an error event",
                    self.timeout_s, len(left))
        for task, req in left:
            req.cut = True
            task.cancel()
        try:
            await asyncio.wait_for(self._idle.wait(), CUT_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("%d request(s) did not end within %gs of being cancelled", len(self.open), CUT_GRACE_S)
        return len(left)
