"""The gateway's HTTP/1.1 client to engines: keep-alive connections per endpoint, bodies as they arrive.

Measured choice (issue 5, bench/overhead.py): on the bench machine aiohttp's client spends about 260 us
of CPU per proxied request; this client, an asyncio protocol around httptools' response parser (the one
uvicorn uses for requests), about 80 us. It does only what the gateway needs: POST a JSON body, read
status and headers, then hand the body over chunk by chunk with no buffering beyond what has arrived.

One connection carries one exchange at a time, and nothing an engine sends can become another request's
answer: parsing stops at the end of each message (bytes after it mark the connection unusable), `1xx`
informational answers are skipped, a pooled connection that has unread bytes when it is taken is
discarded, and an answer's headers may take at most `MAX_HEAD_BYTES`. Engine connections use TCP
keepalive and a TCP user timeout, so a lost host (not a killed process, which closes its sockets) fails
the requests on it within about `DEAD_PEER_S` instead of `read_timeout_s`.

Errors, by what the caller may do about them (their text never names the engine's address, since it
may reach clients; callers log the endpoint beside it):
- `ConnectFailed`: no connection, or it closed before any byte of the answer. The engine did not answer,
  so the request may go to another replica.
- `UpstreamTimeout`: the engine sent nothing for `read_timeout_s` (before its answer or between chunks).
- `UpstreamBroken`: the connection broke, or the engine sent something that is not HTTP, mid-answer.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024  # stop reading from an engine while this much waits for a slow client; read again once taken
MAX_IDLE_PER_TARGET = 64
MAX_HEAD_BYTES = 64 << 10  # an answer's status line and headers
# TCP keepalive: probe after 10 s of silence, every 5 s, give up after 3 unanswered; unacknowledged data
# gives up after the same 25 s (TCP_USER_TIMEOUT). A lost host then fails its requests within ~25 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
DEAD_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


class _NotOurs(Exception):
    """Raised from the parser's callback to stop it at the end of the answer we asked for."""


class UpstreamError(Exception):
    """Base of the errors below; `str()` says what happened, for logs and error bodies."""


class ConnectFailed(UpstreamError):
    """Nothing was answered: safe to send the request to another replica."""


class UpstreamTimeout(UpstreamError):
    """The engine stayed silent for the read timeout."""


class UpstreamBroken(UpstreamError):
    """The answer started and then broke off (or was not HTTP)."""


class AnswerTooLarge(UpstreamBroken):
    """The answer is longer than the reader's limit: the request's doing, not the engine failing."""


@dataclass(frozen=True)
class Target:
    """Where an endpoint URL points: `http://host:port/prefix`. A trailing `/v1` in the URL is dropped,
    since the gateway appends the full OpenAI path (`/v1/chat/completions`)."""

    scheme: str
    host: str
    port: int
    prefix: str
    host_header: bytes
    auth: bytes = b""  # b"Authorization: Bearer <engine key>\r\n" for an engine started with a key (issue 11)


def parse_target(url: str) -> Target:
    """Parse an engine or static endpoint URL. Raises ValueError for anything but http(s)://host[:port]/..."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s):// URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[:-3]
    return Target(parts.scheme, parts.hostname, port, prefix, parts.netloc.encode("idna"))


class Response(asyncio.Protocol):
    """One keep-alive connection to an engine, and the answer being read on it.

    After `Upstream.post` returns it: `status` and `headers` are set; `next_chunk()` returns body bytes as
    they arrive and `b""` at the end; `release()` returns the connection to the pool (or closes it when the
    answer was not read to the end); `abort()` drops it, which an engine notices as a cancelled request.
    """

    def __init__(self, upstream: "Upstream", target: Target):
        self.upstream = upstream
        self.target = target
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.pooled = False  # in the pool: any byte arriving now is not an answer to anything
        self.poller = None  # a select.poll() on the socket, once connected
        self.timer: asyncio.TimerHandle | None = None  # the read deadline (see `_wait`)
        self.wait_from = 0.0  # when the current (or last) wait began
        self.timeout_s: float | None = None  # this answer's silence limit, when not the upstream's (`limit`)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.headers_done = False
        self.done = False
        self.error: UpstreamError | None = None
        self.keep_alive = True
        self.until_eof = False
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.head_bytes = 0
        self.informational = False  # parsing a 1xx answer, which is skipped
        self.content_type: bytes | None = None

    # ---- asyncio protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            keepalive(sock)
            self.poller = select.poll()  # registered once: `has_unread` is then one poll(2) per reuse
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if self.pooled:  # nobody asked: the connection cannot be trusted with the next request
            self.abort()
            return
        if self.done:  # bytes after the end of the answer: read none of them, never reuse
            self.keep_alive = False
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("the engine tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            if self.done:  # `_NotOurs`: another message followed the answer
                self.keep_alive = False
            else:
                self._fail(UpstreamBroken(f"the engine's answer is not valid HTTP ({exc})"))
            return
        if not self.headers_done and not self.informational:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamBroken(f"the engine's answer headers exceed {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self.headers_done and self.until_eof and not self.done:
            self.done = True  # an answer without length or chunking ends when the connection does
        elif not self.done and self.error is None:
            why = f": {exc}" if exc else ""
            self.error = (UpstreamBroken(f"the engine closed the connection mid-answer{why}") if self.headers_done
                          else ConnectFailed(f"the engine closed the connection without answering{why}"))
        self._wake()

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:
            raise _NotOurs

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type" and self.content_type is None:
            self.content_type = value
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: the answer follows
            self.informational = True
            self.headers.clear()
            self.content_type = None
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        names = {n for n, _ in self.headers}
        self.until_eof = b"content-length" not in names and b"transfer-encoding" not in names and self.status not in (204, 304)
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            self.head_bytes = 0
            return
        self.done = True
        self._wake()

    # ---- waiting --------------------------------------------------------------------------------
    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        self.abort()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        """Wait for bytes, an end or an error; `UpstreamTimeout` after `read_timeout_s` of nothing.

        A stream waits once per event, and a timer armed and cancelled per wait was a measurable part of
        the relay's CPU per event (bench/ab.py): so each wait only notes when it began, and one timer per
        connection checks, when it fires, whether the wait in progress has lasted the timeout, re-arming
        for the rest if not. It stays armed across the connection's reuses and is dropped with it."""
        fut = self.loop.create_future()
        self.waiter = fut
        self.wait_from = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(self.wait_from + (self.timeout_s or self.upstream.read_timeout_s),
                                           self._deadline)
        try:
            await fut
        finally:
            self.waiter = None

    def _deadline(self) -> None:
        self.timer = None
        w = self.waiter
        if w is None or w.done() or self.closed:
            return  # not waiting: the next wait arms it again
        seconds = self.timeout_s or self.upstream.read_timeout_s
        at = self.wait_from + seconds
        if at > self.loop.time():  # this wait began after the one the timer was armed for
            self.timer = self.loop.call_at(at, self._deadline)
            return
        self.waiter = None
        w.set_exception(UpstreamTimeout(f"the engine sent nothing for {seconds:g}s"))

    def limit(self, seconds: float | None) -> None:
        """Wait at most `seconds` of silence from now on (`UpstreamTimeout` after it); None: the upstream's
        `read_timeout_s` again. Between waits only (the relay's stall detection, gateway/resume.py)."""
        if seconds != self.timeout_s:
            self.timeout_s = seconds
            self._disarm()  # the next wait arms the timer for the new limit

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # ---- the caller's side ----------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """The whole body has arrived and been taken: the chunk in hand is the last."""
        return self.done and not self.chunks

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), or None."""
        for n, v in self.headers:
            if n == name:
                return v
        return None

    def has_unread(self) -> bool:
        """Bytes (or an end of stream) wait on the socket while nothing was asked: not reusable."""
        return bool(self.poller.poll(0)) if self.poller is not None else False

    async def _send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.pooled = False
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some), or b"" at the end."""
        while True:
            if self.chunks:
                data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return data
            if self.done:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self, limit: int = 1 << 20) -> bytes:
        """The rest of the body, up to `limit` bytes (the rest is dropped with the connection)."""
        out = bytearray()
        while len(out) < limit:
            chunk = await self.next_chunk()
            if not chunk:
                break
            out += chunk
        return bytes(out[:limit])

    async def read_whole(self, limit: int) -> bytes:
        """The whole rest of the body; `UpstreamBroken` if it is longer than `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await self.next_chunk()
            size += len(chunk)
            if size > limit:
                self.abort()
                raise AnswerTooLarge(f"the engine's answer is longer than {limit} bytes")
            if chunk:
                parts.append(chunk)
            if not chunk or self.complete:  # (usually the first chunk is the whole answer)
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the answer: keep the connection for the next request if it was read to the end."""
        if self.done and self.keep_alive and not self.closed and self.error is None:
            self.limit(None)
            self._reset()
            self.pooled = True
            self.upstream._put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the connection now (the engine sees its request cancelled)."""
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.abort()


def keepalive(sock) -> None:
    """TCP keepalive and user timeout on an engine connection (where the OS has them)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_S * 1000)
    except OSError:  # not TCP (a test's Unix socket), or an OS without them
        pass


class Upstream:
    """Connections to engines, kept open between requests, one pool per target."""

    def __init__(self, read_timeout_s: float, connect_timeout_s: float = 5.0):
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle: dict[Target, list[Response]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _put(self, conn: Response) -> None:
        pool = self.idle.setdefault(conn.target, [])
        if len(pool) < MAX_IDLE_PER_TARGET:
            pool.append(conn)
        else:
            conn.abort()

    async def _connect(self, target: Target) -> Response:
        loop = asyncio.get_running_loop()
        kw: dict = {}
        if target.scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            kw = {"ssl": self._ssl, "server_hostname": target.host}
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Response(self, target), target.host, target.port, **kw),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"no connection within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect ({exc.strerror or type(exc).__name__})") from None
        return conn

    async def get(self, target: Target, path: str) -> Response:
        """GET `target` + `path` (an engine's `/version`, gateway/dialects.py), as `post` sends."""
        return await self.post(target, path, b"", b"GET")

    async def post(self, target: Target, path: str, body: bytes, method: bytes = b"POST") -> Response:
        """POST `body` (JSON) to `target` + `path`; returns once status and headers have arrived.

        Raises `ConnectFailed`, `UpstreamTimeout` or `UpstreamBroken`. A kept-alive connection that the
        engine had closed meanwhile is retried once on a fresh one.
        """
        head = (b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"User-Agent: llmgw\r\n%s\r\n" % (method, (target.prefix + path).encode(), target.host_header, len(body),
                                             target.auth))
        pool = self.idle.get(target)
        while pool:
            conn = pool.pop()
            if conn.closed or conn.has_unread():
                conn.abort()
                continue
            try:
                await conn._send(head, body)
                return conn
            except ConnectFailed:
                conn.abort()  # closed by the engine while idle: try a fresh connection
                break
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect(target)
        try:
            await conn._send(head, body)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def close(self) -> None:
        for pool in self.idle.values():
            for conn in pool:
                conn.abort()
        self.idle.clear()
