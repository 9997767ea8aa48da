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
- a **send deadline**: a client that reads nothing of its answer for `send_timeout_s` is dropped (with a
  reset, which discards what the kernel still held for it), which cancels the request (an engine slot is
  never held by a client that stopped reading);
- a **connection limit**: at `max_connections`, a new connection closes the oldest one that has no
  request in progress (idle keep-alive, or still sending its headers); if every one is busy, the new one
  gets 503 and is closed;
- a **per-client cap**: at most `max_connections_per_client` connections from one peer address (an IPv6
  peer by its /64, which one host is given); a client at its cap makes way with its own oldest idle
  connection, else its new one gets 429 and is closed: never another client's connection;
- a **per-credential cap**: at most `max_connections_per_key` connections whose latest request carries the
  same `Authorization` value (an API key, the admin token), whatever addresses they come from; checked
  when the headers arrive, before the app runs (the same making way, else 429 and close);
- an **early answer closes**: a request the app answered before its body had arrived (a 401, a 429 of
  admission, a 404) is not waited for: the connection is half-closed and what still arrives is dropped
  until the client is quiet for `LINGER_S` (`LINGER_MAX_S` at most), then it closes;
- a **minimum transfer rate** (`min_transfer_bytes_per_s`, judged over `transfer_grace_s`): a body that
  arrives slower gets 408 and close; a client that, while the server waits on it (its answer's bytes are
  pending: writing is paused), takes them slower is dropped. An answer the server has little to send (a
  stream paced by an engine) is never judged: only time spent waiting on the client counts;
- a **chunk bound**: a chunked body whose chunks average under `min_chunk_bytes` after `FREE_CHUNKS`
  chunks (1-byte chunks cost ~40x the CPU of the same bytes in one) gets 400 and close.

Only the calls uvicorn makes on a protocol are extended, and each fast path costs nothing: a request
that arrives in one read arms no timer beyond the one per connection. Each request's cycle writes its
response head as llmgw/http/response_head.py says (fewer steps per header, and the `llmgw.head` extension).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import signal
import socket
import ssl
import struct
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from llmgw.http import response_head
from llmgw.http.response_head import HeadCycle
from llmgw.security.pki import cert_addresses, common_name

log = logging.getLogger(__name__)


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
    max_connections_per_client: int = 256  # 0: no cap
    max_connections_per_key: int = 1024  # 0: no cap
    min_transfer_bytes_per_s: int = 4096  # 0: no minimum
    transfer_grace_s: float = 10.0
    min_chunk_bytes: int = 512  # 0: no bound


def listener_limits(settings, max_body_bytes: int | None = None) -> ListenerLimits:
    """`settings` (a `config.Settings`) as one listener's limits; `max_body_bytes` overrides its request bound."""
    return ListenerLimits(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                          send_timeout_s=settings.send_timeout_s, max_header_bytes=settings.max_header_bytes,
                          max_body_bytes=max_body_bytes or settings.max_request_bytes,
                          max_connections=settings.max_connections,
                          max_connections_per_client=settings.max_connections_per_client,
                          max_connections_per_key=settings.max_connections_per_key,
                          min_transfer_bytes_per_s=settings.min_transfer_bytes_per_s,
                          transfer_grace_s=settings.transfer_grace_s, min_chunk_bytes=settings.min_chunk_bytes)


def client_of(address: str) -> str:
    """The name a peer's connections are counted under: an IPv4 address as it is (an IPv4-mapped IPv6 one
    as its IPv4), an IPv6 address by its /64 (what one host or one customer is given: counting each
    address would give one client 2^64 caps)."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return ip.exploded[:19] + "::/64"


def _error(status: bytes, message: str, code: str, extra: bytes = b"", kind: str | None = None) -> bytes:
    kind = kind or ("invalid_request_error" if status[:1] == b"4" else "service_unavailable")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
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
CLIENT_429 = _error(b"429 Too Many Requests", "too many connections from this client address; reuse open "
                   "connections or close idle ones", "too_many_client_connections", b"retry-after: 1\r\n",
                   "rate_limit_exceeded")
KEY_429 = _error(b"429 Too Many Requests", "too many connections with this API key (Authorization); reuse "
                 "open connections or close idle ones", "too_many_key_connections", b"retry-after: 1\r\n",
                 "rate_limit_exceeded")
# After an answer given while the client still sends (nginx's lingering_close): what arrives is read and
# dropped until the client is quiet for LINGER_S, for at most LINGER_MAX_S in all, then the connection ends.
LINGER_S = 2.0
LINGER_MAX_S = 10.0  # (a lingering connection has no request in progress: the first to make way at a cap)
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and discards the send buffer
FREE_CHUNKS = 64  # chunks of a chunked body before their average size is judged


def too_large_413(limit: int) -> bytes:
    return _error(b"413 Content Too Large", f"the request body is larger than {limit} bytes", "request_too_large")


def too_slow_408(rate: int) -> bytes:
    return _error(b"408 Request Timeout", f"the request body arrived slower than {rate} bytes/s",
                  "request_too_slow")


def small_chunks_400(size: int) -> bytes:
    return _error(b"400 Bad Request", f"the chunked request body's chunks average under {size} bytes; send "
                  f"larger chunks, or the body with a Content-Length", "chunks_too_small")


def _registry(server_state, name: str) -> dict:
    """One listener's table of connections by client or by credential (kept on uvicorn's per-server state)."""
    table = getattr(server_state, name, None)
    if table is None:
        table = {}
        setattr(server_state, name, table)
    return table


class GuardedCycle(HeadCycle):
    """A request's cycle on a guarded listener: an answer given before the request's body has come ends the
    connection (`GuardedProtocol.on_response_complete`), and its head says `connection: close`."""

    ends_early = True


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines, caps and connection limits of `ListenerLimits`
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
        self._linger_ends: float | None = None  # lingering (reading and dropping) until then at the latest
        self._client: str | None = None  # the name it is counted under among its client's connections
        self._credential: bytes | None = None  # the Authorization value of its latest request
        self._chunks = 0  # chunks of this request's body (chunked), and the bytes they carried
        self._chunk_bytes = 0
        self._read_check: asyncio.TimerHandle | None = None  # the body's transfer rate ...
        self._window_bytes = 0  # ... the body's bytes when its window began
        self._write_check: asyncio.TimerHandle | None = None  # the answer's transfer rate while paused ...
        self._waited_s = 0.0  # ... time spent waiting on the client in this window,
        self._taken = 0  # ... the bytes it took meanwhile,
        self._wait_began: float | None = None  # ... since when it is being waited on now,
        self._wait_pending = 0  # ... with this many bytes pending then

    # ---- connections ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened_at = self.loop.time()
        cap = self.limits.max_connections_per_client
        if cap and self.client:
            self._client = client_of(self.client[0])
            mine = _registry(self.server_state, "llmgw_clients").setdefault(self._client, {})
            mine[self] = None
            if len(mine) > cap and not self._evict_idle(mine):
                self.transport.write(CLIENT_429)  # its own connections are busy: never another client's
                self.transport.close()
                return
        if len(self.connections) > self.limits.max_connections and not self._evict_idle(self.connections):
            self.transport.write(BUSY_503)
            self.transport.close()
            return
        self._arm(self.limits.header_timeout_s)

    def _evict_idle(self, among) -> bool:
        """Close the oldest connection of `among` with no request in progress (idle keep-alive, or still
        sending its headers); False when every one is busy."""
        oldest = None
        for p in among:
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
        for name in ("_send_timer", "_read_check", "_write_check"):
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)
        if self._client is not None:
            self._forget("llmgw_clients", self._client)
            self._client = None
        if self._credential is not None:
            self._forget("llmgw_keys", self._credential)
            self._credential = None
        super().connection_lost(exc)

    def _forget(self, table: str, name) -> None:
        registry = _registry(self.server_state, table)
        mine = registry.get(name)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del registry[name]

    def _admit_credential(self, credential: bytes | None) -> bool:
        """Count this connection under the request's `Authorization` value (another than its previous
        request's); False when that credential's connections are at their cap and none of them is idle."""
        if self._credential is not None:
            self._forget("llmgw_keys", self._credential)
        self._credential = credential
        if credential is None:
            return True
        mine = _registry(self.server_state, "llmgw_keys").setdefault(credential, {})
        mine[self] = None
        return len(mine) <= self.limits.max_connections_per_key or self._evict_idle(mine)

    # ---- reading --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            if self._linger_ends is not None and self._timer is not None:  # the client still sends: wait on
                self._timer.cancel()
                self._timer = self.loop.call_at(min(self.loop.time() + LINGER_S, self._linger_ends),
                                                self.transport.abort)
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
            if self.limits.min_transfer_bytes_per_s and self._read_check is None:  # a body in several reads
                self._window_bytes = self._body_bytes
                self._read_check = self.loop.call_later(self.limits.transfer_grace_s, self._read_rate)

    def on_message_begin(self) -> None:
        self._head_begun = self._fresh_head = True
        super().on_message_begin()
        self.scope["extensions"] = {response_head.EXTENSION: {}}

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._cancel()
        # Every whole head is measured here, before the app runs: the reads' count above misses the read a
        # head began in and the one it ended in (a head of twice the cap in two reads was served).
        # (`_in_head` still holds: a refusal here is written even after an answered request on the connection.)
        if self._head_size() > self.limits.max_header_bytes:
            self._refuse(HEADERS_431, linger=True)
            return
        length = None
        credential = None
        for name, value in self.headers or ():
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    pass
            elif name == b"authorization":
                credential = value
            elif name == b"x-api-key" and credential is None:  # Anthropic's clients: counted as the same key
                credential = b"Bearer " + value
        if length is not None and length > self.limits.max_body_bytes:
            self._refuse(too_large_413(self.limits.max_body_bytes), linger=True)  # before the app runs or a byte is read
            return
        if credential != self._credential and self.limits.max_connections_per_key \
                and not self._admit_credential(credential):  # (a kept-alive connection's next request: no call)
            self._refuse(KEY_429, linger=True)
            return
        self._in_head = False
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:  # just made (its task has not run): the head as llmgw writes it
            self.cycle.__class__ = GuardedCycle

    def on_chunk_header(self) -> None:
        """httptools calls this for each chunk of a chunked body (the last, empty one too)."""
        if self._refused:  # (the rest of the read is parsed: a callback that raises would log a parser error)
            return
        self._chunks += 1
        least = self.limits.min_chunk_bytes
        if least and self._chunks > FREE_CHUNKS and self._chunk_bytes < (self._chunks - 1) * least:
            self._refuse(small_chunks_400(least), linger=True)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            self._chunk_bytes += len(body)
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._cancel()
        if self._read_check is not None:
            self._read_check.cancel()
            self._read_check = None
        self._in_head = True
        self._head_begun = False
        self._fresh_head = True  # this read's bytes belonged to this message: the next head counts from the next
        self._head_bytes = self._body_bytes = self._chunks = self._chunk_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """An answer is complete. One given before the request's body had arrived (a 401, a 429 of
        admission, a 404) ends the connection: the rest of the body is not waited for (a client refused
        at once could otherwise trickle it in for the body deadline) but read and dropped for a moment, so
        the answer is not lost to a reset."""
        cycle = self.cycle  # (a request pipelined behind the one answered has its own cycle: not complete)
        if cycle is not None and cycle.more_body and cycle.response_complete and not self._refused \
                and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self._refused = True
            self._cancel()
            self._linger()
            return
        if getattr(cycle, "said_close", False) and not self.transport.is_closing():
            self.transport.close()  # answered early, its body came all the same meanwhile: closed as its head said
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:  # uvicorn's, for a request its parser refused
        """The parser's refusal (conflicting Content-Length and Transfer-Encoding, a NUL in a header, ...) in
        the OpenAI envelope every other error has, not uvicorn's text/plain line."""
        if self._refused:  # the request was refused already, and answered
            return
        self._refuse(MALFORMED_400)

    def _head_size(self) -> int:
        """The request line's and headers' bytes as written (give or take their separators)."""
        return len(self.url) + 16 + sum(len(n) + len(v) + 4 for n, v in self.headers or ())

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

    def _read_rate(self) -> None:
        """Every `transfer_grace_s` while a body arrives: at least `min_transfer_bytes_per_s` of it in the
        window, else 408 and close. A window in which the server had stopped reading (the app not taking
        the body yet) is not held against the client."""
        self._read_check = None
        cycle = self.cycle
        if self._refused or self._in_head or cycle is None or not cycle.more_body or cycle.response_complete \
                or self.transport.is_closing():
            return
        rate, window = self.limits.min_transfer_bytes_per_s, self.limits.transfer_grace_s
        if not self.flow.read_paused and self._body_bytes - self._window_bytes < rate * window:
            self._refuse(too_slow_408(rate))
            return
        self._window_bytes = self._body_bytes
        self._read_check = self.loop.call_later(window, self._read_rate)

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
        if linger:
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Half-close, read and drop what still arrives until the client is quiet for `LINGER_S` (at most
        `LINGER_MAX_S` in all), then abort (see `_refuse`)."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_ends = self.loop.time() + LINGER_MAX_S
        self._timer = self.loop.call_later(LINGER_S, self.transport.abort)

    # ---- writing ------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        now = self._paused_at = self.loop.time()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_expired)
        if self.limits.min_transfer_bytes_per_s:
            self._wait_began = now
            self._wait_pending = self.transport.get_write_buffer_size()
            if self._write_check is None:
                self._write_check = self.loop.call_later(max(self.limits.transfer_grace_s - self._waited_s, 0.0),
                                                         self._write_rate)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._paused_at = None  # (the timer stays: a stream pauses and resumes often, re-arming would cost)
        if self._wait_began is not None:  # the client took what was pending, down to the low-water mark
            self._waited_s += self.loop.time() - self._wait_began
            self._taken += max(self._wait_pending - self.transport.get_write_buffer_size(), 0)
            self._wait_began = None

    def _write_rate(self) -> None:
        """The answer's transfer rate, judged over `transfer_grace_s` of waiting on the client: while writing
        is paused (its bytes pending, the client not taking them), it must take `min_transfer_bytes_per_s`.
        Only paused time counts, so an answer the server has little to send (a stream paced by its engine)
        is never judged; a reader slower than the minimum is dropped (the app sees a disconnect) however
        often it takes a little (which had reset the send deadline: 48 KiB a minute kept a slot forever)."""
        self._write_check = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        waited, taken = self._waited_s, self._taken
        if self._wait_began is not None:
            waited += now - self._wait_began
            taken += max(self._wait_pending - self.transport.get_write_buffer_size(), 0)
        window = self.limits.transfer_grace_s
        if waited < window:  # waited on it less than a window so far: judged once it has been
            if self._wait_began is not None:
                self._write_check = self.loop.call_later(window - waited, self._write_rate)
            return
        if taken < self.limits.min_transfer_bytes_per_s * waited:
            self._drop()
            return
        self._waited_s, self._taken = 0.0, 0  # a new window
        if self._wait_began is not None:
            self._wait_began, self._wait_pending = now, self.transport.get_write_buffer_size()
            self._write_check = self.loop.call_later(window, self._write_rate)

    def _send_expired(self) -> None:
        """The client read nothing for `send_timeout_s`: drop it (the app sees a disconnect)."""
        self._send_timer = None
        if self._paused_at is None:
            return
        left = self._paused_at + self.limits.send_timeout_s - self.loop.time()
        if left > 0:  # paused again since: wait for the rest
            self._send_timer = self.loop.call_later(left, self._send_expired)
            return
        self._drop()

    def _drop(self) -> None:
        """End the connection with a reset, discarding what is pending for the client (the app sees a
        disconnect). A plain close would leave the kernel to go on sending its buffer (up to
        `net.ipv4.tcp_wmem`'s 4 MiB) to the very reader being dropped, for as long as it cares to read."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
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
    # uvicorn's graceful shutdown: how long connections still busy when the listener closes may go on before
    # their tasks are cancelled. The gateway drains first (gateway/drain.py), so this only bounds the rest.
    graceful_s: float = 5.0


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve(listeners: list[Listener], stop: asyncio.Event, log_level: str = "warning",
                before_close: Callable[[], Awaitable[object]] | None = None) -> None:
    """Serve every listener until `stop` is set or one of them fails. `before_close` is awaited once `stop`
    is set, while every listener still serves (the gateway's drain), before they close."""
    servers = [_Server(_config(lst, log_level)) for lst in listeners]
    tasks = [asyncio.create_task(s.serve(), name=lst.name) for s, lst in zip(servers, listeners)]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    if waiter in done and before_close is not None:
        try:
            await before_close()
        except Exception:  # noqa: BLE001 - the listeners close all the same
            log.exception("before closing the listeners")
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


def make_server(listener: Listener, log_level: str = "warning") -> uvicorn.Server:
    """One listener's server, for a caller that runs it itself (`server.serve(sockets=[...])` on a socket
    it bound, to learn the port) and keeps a hand on it (its TLS context: `server.config.ssl` once started)."""
    return _Server(_config(listener, log_level))


def server_name(listener: str) -> str:
    """The `server` header of a listener's answers: `llmgw-gateway`, `llmgw-admin`, `llmgw-node-api`, ..."""
    return f"llmgw-{listener}"


def _config(listener: Listener, log_level: str) -> uvicorn.Config:
    # `server: llmgw-<listener>` on every answer (no version: the gateway's is public), so a client sent to the
    # wrong port can say what it reached (ctl/client.py) instead of failing on an answer it cannot read.
    kw: dict = dict(host=listener.host, port=listener.port, log_level=log_level, lifespan=listener.lifespan,
                    access_log=False, timeout_graceful_shutdown=listener.graceful_s, http=GuardedProtocol,
                    server_header=False, headers=[("server", server_name(listener.name))])
    tls = listener.tls
    if tls is not None:
        kw.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.ca_cert:
            kw.update(ssl_ca_certs=tls.ca_cert, ssl_cert_reqs=ssl.CERT_REQUIRED, http=TLSIdentityProtocol)
    config = uvicorn.Config(listener.app, **kw)
    config.listener_limits = listener.limits  # type: ignore[attr-defined]
    return config
