"""Run ASGI apps on their own listeners, stopping all on SIGINT/SIGTERM; every listener is hardened.

Each listener (gateway, admin API, node API, mirror) runs uvicorn with httptools and `GuardedProtocol`,
which adds what uvicorn's httptools protocol lacks, so that half-open and slow clients cannot hold
connections or stall the event loop (docs/security.md, "Listeners"):

- a **header deadline**: a connection must deliver a request's line and headers within `header_timeout_s`
  of connecting (or of that request's first byte, on a kept-alive connection); else 408 and close;
- a **body deadline**: the body must arrive within `body_timeout_s` of the headers; else 408 and close;
- a **header size cap**: at most `max_header_bytes` of request line and headers, counted over the reads
  they arrive in (httptools joins a header's pieces from one read to the next, which is quadratic: the
  cap stops it after `max_header_bytes` plus one read), and measured whole once they have all arrived,
  however many reads that took; else 431 and close;
- a **body size cap**: a `Content-Length` above `max_body_bytes` is refused before the body is read, and a
  chunked body is cut off as soon as it passes it; 413 in the OpenAI error envelope;
- a **send deadline**: a client that reads nothing of its answer for `send_timeout_s` is dropped, which
  cancels the request (an engine slot is never held by a client that stopped reading);
- a **connection limit**: at `max_connections`, a new connection closes the oldest one that has no
  request in progress (idle keep-alive, or still sending its headers); if every one is busy, the new one
  gets 503 and is closed.

Only the calls uvicorn makes on a protocol are extended, and each fast path costs nothing: a request
that arrives in one read arms no timer beyond the one per connection. Each request's cycle writes its
response head as llmgw/http/response_head.py says (fewer steps per header, and the `llmgw.head` extension).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
from dataclasses import dataclass, field

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from llmgw.http import response_head
from llmgw.http.response_head import HeadCycle
from llmgw.security.pki import cert_addresses, common_name


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process installs its own handlers for all listeners
        yield


@dataclass(frozen=True)
class ListenerLimits:
    """What one listener tolerates from a client (seconds, bytes, connections). Defaults: config.py."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10
    max_body_bytes: int = 64 << 20
    max_connections: int = 4096


def listener_limits(settings, max_body_bytes: int | None = None) -> ListenerLimits:
    """`settings` (a `config.Settings`) as one listener's limits; `max_body_bytes` overrides its request bound."""
    return ListenerLimits(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                          send_timeout_s=settings.send_timeout_s, max_header_bytes=settings.max_header_bytes,
                          max_body_bytes=max_body_bytes or settings.max_request_bytes,
                          max_connections=settings.max_connections)


def _error(status: bytes, message: str, code: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status[:1] == b"4" else
                                 "service_unavailable", "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n" + extra +
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


TIMEOUT_408 = _error(b"408 Request Timeout", "the request did not arrive in time", "request_timeout")
HEADERS_431 = _error(b"431 Request Header Fields Too Large", "the request line and headers are too large",
                     "request_headers_too_large")
BUSY_503 = _error(b"503 Service Unavailable", "too many connections; retry shortly", "too_many_connections",
                  b"retry-after: 1\r\n")


MALFORMED_400 = _error(b"400 Bad Request", "the request is not valid HTTP/1.1 (its request line, a header, or its "
                       "Content-Length and Transfer-Encoding); send one request with one Content-Length or chunked "
                       "encoding, and no control characters in headers", "invalid_http")
LINGER_S = 2.0


def too_large_413(limit: int) -> bytes:
    return _error(b"413 Content Too Large", f"the request body is larger than {limit} bytes", "request_too_large")


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines, caps and connection limit of `ListenerLimits`
    (read from `config.listener_limits`, set by `serve`). See the module docstring for what each refuses."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits: ListenerLimits = getattr(config, "listener_limits", None) or ListenerLimits()
        self._timer: asyncio.TimerHandle | None = None  # the header or the body deadline (never both)
        self._send_timer: asyncio.TimerHandle | None = None
        self._paused_at: float | None = None  # when writing was last paused (the client not reading)
        self._in_head = True  # the next bytes belong to a request line or headers
        self._head_begun = False  # ... and the request has begun
        self._fresh_head = False  # ... in the read being parsed
        self._head_bytes = 0
        self._body_bytes = 0
        self._opened_at = 0.0
        self._refused = False  # answered and closing: the parser's remaining callbacks are ignored

    # ---- connections ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened_at = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self.transport.write(BUSY_503)
            self.transport.close()
            return
        self._arm(self.limits.header_timeout_s)

    def _evict_idle(self) -> bool:
        """Close the oldest connection with no request in progress (idle keep-alive, or still sending its
        headers); False when every one is busy."""
        oldest = None
        for p in self.connections:
            if p is self or not isinstance(p, GuardedProtocol) or p.transport.is_closing():
                continue
            if p.cycle is not None and not p.cycle.response_complete:
                continue
            if oldest is None or p._opened_at < oldest._opened_at:
                oldest = p
        if oldest is None:
            return False
        oldest.transport.close()
        return True

    def connection_lost(self, exc) -> None:
        self._cancel()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    # ---- reading --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_head:  # (a bound: the read may end the body and begin the next request)
            self._body_bytes += len(data)
            if self._body_bytes > self.limits.max_body_bytes:
                self._refuse(too_large_413(self.limits.max_body_bytes), linger=True)
                return
        self._fresh_head = False
        super().data_received(data)
        if self._refused:
            return
        if self._in_head:
            # Counted across reads: within one read httptools joins nothing, so only the reads a head is
            # spread over make its cost grow; a head that began in this read is counted from the next.
            if not self._fresh_head:
                self._head_bytes += len(data)
                if self._head_bytes > self.limits.max_header_bytes:
                    self._refuse(HEADERS_431, linger=True)
                    return
            if self._head_begun and self._timer is None:  # half a request: the rest must follow in time
                self._arm(self.limits.header_timeout_s)
        elif self._timer is None and self.cycle is not None and self.cycle.more_body and not self.cycle.response_complete:
            self._arm(self.limits.body_timeout_s)

    def on_message_begin(self) -> None:
        self._head_begun = self._fresh_head = True
        super().on_message_begin()
        self.scope["extensions"] = {response_head.EXTENSION: {}}

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._cancel()
        # Every whole head is measured here, before the app runs: the reads' count above misses the read a
        # head began in and the one it ended in (a head of twice the cap in two reads was served).
        if self._head_size() > self.limits.max_header_bytes:
            self._refuse(HEADERS_431, linger=True)
            return
        length = self._content_length()
        if length is not None and length > self.limits.max_body_bytes:
            self._refuse(too_large_413(self.limits.max_body_bytes), linger=True)  # before the app runs or a byte is read
            return
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:  # just made (its task has not run): the head as llmgw writes it
            self.cycle.__class__ = HeadCycle

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._cancel()
        self._in_head = True
        self._head_begun = False
        self._fresh_head = True  # this read's bytes belonged to this message: the next head counts from the next
        self._head_bytes = self._body_bytes = 0
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:  # uvicorn's, for a request its parser refused
        """The parser's refusal (conflicting Content-Length and Transfer-Encoding, a NUL in a header, ...) in
        the OpenAI envelope every other error has, not uvicorn's text/plain line."""
        self._refuse(MALFORMED_400)

    def _head_size(self) -> int:
        """The request line's and headers' bytes as written (give or take their separators)."""
        return len(self.url) + 16 + sum(len(n) + len(v) + 4 for n, v in self.headers or ())

    def _content_length(self) -> int | None:
        for name, value in self.headers or ():
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    # ---- deadlines --------------------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._in_head and not self._head_begun:
            self.transport.close()  # connected and said nothing: nobody to answer
            return
        self._refuse(TIMEOUT_408)

    def _refuse(self, response: bytes, linger: bool = False) -> None:
        """Answer `response` (unless an answer has begun) and close; the app, if running, sees a disconnect.

        With `linger` (the client may still be sending), the connection is half-closed and what arrives
        for a moment more is read and dropped: closing with unread input makes the kernel answer with a
        reset, which can destroy the response before the client reads it."""
        self._cancel()
        self._refused = True
        cycle = self.cycle
        # Written unless this request has an answer already: while a head is read, `cycle` is the previous
        # request's (answered); in the body, it is this one's, and an app that answered before the body
        # came (a 401, a 404) has said all there is to say: the connection is only closed.
        if cycle is None or not cycle.response_started or (self._in_head and cycle.response_complete):
            self.transport.write(response)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.flow.resume_reading()
            self._timer = self.loop.call_later(LINGER_S, self.transport.abort)
        else:
            self.transport.close()

    # ---- writing ------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._paused_at = self.loop.time()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._paused_at = None  # (the timer stays: a stream pauses and resumes often, re-arming would cost)

    def _send_expired(self) -> None:
        """The client read nothing for `send_timeout_s`: drop it (the app sees a disconnect)."""
        self._send_timer = None
        if self._paused_at is None:
            return
        left = self._paused_at + self.limits.send_timeout_s - self.loop.time()
        if left > 0:  # paused again since: wait for the rest
            self._send_timer = self.loop.call_later(left, self._send_expired)
            return
        self.transport.abort()


class TLSIdentityProtocol(GuardedProtocol):
    """HTTP/1.1 protocol that puts the verified client certificate's common name into the ASGI scope
    as the ASGI TLS extension (`scope["extensions"]["tls"]["client_cert_name"]`), which uvicorn does
    not fill in itself. The TLS handshake has already verified the chain against our CA. Beside it: the
    certificate's IP and DNS names and the connection's peer address, read from the socket (never from a
    forwarding header), which the node API checks reported endpoints against, and the certificate's serial
    and notBefore, which it checks against the deny-list."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        ssl_object = self.transport.get_extra_info("ssl_object")
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        ips, names = cert_addresses(cert)
        peer = self.transport.get_extra_info("peername")
        self.scope["extensions"]["tls"] = {"client_cert_name": common_name(cert), "client_cert_ips": ips,
                                           "client_cert_names": names, "peer_address": peer[0] if peer else None,
                                           # the deny-list's keys (control/revocations.py)
                                           "client_cert_serial": (cert or {}).get("serialNumber"),
                                           "client_cert_not_before": (cert or {}).get("notBefore")}


@dataclass
class TLS:
    """Server TLS; with `ca_cert`, clients must present a certificate signed by it (mutual TLS)."""

    cert: str
    key: str
    ca_cert: str | None = None


@dataclass
class Listener:
    app: object
    host: str
    port: int
    name: str
    lifespan: str = "on"
    tls: TLS | None = None
    limits: ListenerLimits = field(default_factory=ListenerLimits)


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve(listeners: list[Listener], stop: asyncio.Event, log_level: str = "warning") -> None:
    """Serve every listener until `stop` is set or one of them fails."""
    servers = [_Server(_config(lst, log_level)) for lst in listeners]
    tasks = [asyncio.create_task(s.serve(), name=lst.name) for s, lst in zip(servers, listeners)]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    waiter.cancel()
    for t in done:
        if t is not waiter and t.exception():
            raise t.exception()  # type: ignore[misc]
    for s, lst in zip(servers, listeners):
        if not s.started:
            raise SystemExit(f"{lst.name} could not listen on {lst.host}:{lst.port}")


def _config(listener: Listener, log_level: str) -> uvicorn.Config:
    kw: dict = dict(host=listener.host, port=listener.port, log_level=log_level, lifespan=listener.lifespan,
                    access_log=False, timeout_graceful_shutdown=5, http=GuardedProtocol)
    tls = listener.tls
    if tls is not None:
        kw.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.ca_cert:
            kw.update(ssl_ca_certs=tls.ca_cert, ssl_cert_reqs=ssl.CERT_REQUIRED, http=TLSIdentityProtocol)
    config = uvicorn.Config(listener.app, **kw)
    config.listener_limits = listener.limits  # type: ignore[attr-defined]
    return config
