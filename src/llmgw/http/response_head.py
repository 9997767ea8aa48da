"""A response's status line and headers (its head), written with less work per header than uvicorn's
httptools cycle does, and with header lines an app has already made safe (issue 15: the `x-ratelimit-*`
headers of every answer to a key with limits).

uvicorn checks each response header in Python: two regular-expression searches, a lower-casing and three
compares, per header and per answer, the server's own `date` and `server` headers included. `HeadCycle`
writes the same bytes and keeps the same state with fewer steps:

- the names and the values are each checked with one search over all of them joined (both expressions
  match single characters, so a search over the joined bytes finds a bad one exactly when one header has
  it), and refused with uvicorn's own errors;
- the server's default headers (`date`, `server`), which change once a second, are joined once per change;
- a start message may carry `"llmgw.head"`: bytes of complete `name: value\\r\\n` lines that the app made
  from names and values of its own (digits and durations) and that are written as they are, after the
  headers. A server that offers this says so in `scope["extensions"]["llmgw.head"]`; an app must send a
  plain `headers` list to any other (`head_lines` turns the block back into one).

Everything else (the body, flow control, access logging when it is on) is uvicorn's, but for a body of
unknown length to an HTTP/1.0 client, which ends with the connection instead of being chunked. tests/test_response_head.py
sends the same messages through this cycle and through uvicorn's and compares the bytes and the state.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle

EXTENSION = "llmgw.head"  # the scope extension, and the start message's key for the block of safe lines
_WATCHED = frozenset((b"content-length", b"transfer-encoding", b"connection"))
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"


class _Defaults:
    """The default headers' joined lines, for the list the server made last (it makes a new one a second)."""

    __slots__ = ("source", "block")

    def __init__(self) -> None:
        self.source: object = None  # held, so its id cannot be reused while it is the key
        self.block: bytes | None = b""

    def lines(self, headers: list) -> bytes | None:
        """The lines of `headers`, checked, or None when one of them is a header the cycle must act on."""
        if headers is self.source:
            return self.block
        block: bytes | None
        if not headers:
            block = b""
        elif any(bytes(h[0]).lower() in _WATCHED for h in headers):
            block = None
        else:
            _check(headers)
            block = b"".join(b"%s: %s\r\n" % (bytes(h[0]).lower(), bytes(h[1])) for h in headers)
        self.source, self.block = headers, block
        return block


_defaults = _Defaults()


def _check(headers) -> None:
    if HEADER_RE.search(b"".join([h[0] for h in headers])) is not None:
        raise RuntimeError("Invalid HTTP header name.")
    if HEADER_VALUE_RE.search(b"".join([h[1] for h in headers])) is not None:
        raise RuntimeError("Invalid HTTP header value.")


def head_lines(block: bytes) -> list[tuple[bytes, bytes]]:
    """A block of `name: value\\r\\n` lines as a header list (for a server without the extension)."""
    return [tuple(line.split(b": ", 1)) for line in block.split(b"\r\n") if line]  # type: ignore[misc]


_send = RequestResponseCycle.send


class HeadCycle(RequestResponseCycle):
    """uvicorn's request-response cycle with the start of the response written as the module says.

    `send` is a plain function that returns the awaitable to await: uvicorn's own for every message but
    the start, so a streamed answer's events cost no extra coroutine each.

    An answer of unknown length (a stream) to an HTTP/1.0 request is not chunked, which such a client
    cannot read (RFC 9112 7.1: a server must not send chunked to one): its body ends where the connection
    does (`_until_close`), as HTTP/1.0 delimits bodies."""

    _until_close = False  # this answer's body is delimited by closing the connection (HTTP/1.0, no length)
    # The connection ends with an answer given before the request's body has all come (serving.py's guarded
    # listeners close it: `GuardedProtocol.on_response_complete`); uvicorn's own would read on.
    ends_early = False
    said_close = False  # its head said `connection: close` while the cycle stayed keep-alive (an early answer)

    def send(self, message):  # type: ignore[override]
        if self._until_close:
            return self._body_until_close(message)
        if self.response_started or self.access_log or message["type"] != "http.response.start":
            return _send(self, message)
        return self._start(message)

    async def _body_until_close(self, message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
        body = message.get("body", b"")
        if body:
            self.transport.write(body)
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()  # the end of the body
            self.on_response()

    async def _start(self, message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        self.response_started = True
        self.waiting_for_100_continue = False
        status_code = message["status"]
        headers = message.get("headers") or ()
        defaults = _defaults.lines(self.default_headers)
        if defaults is None:  # a default header the cycle acts on (not one uvicorn makes): as a header
            headers = [*self.default_headers, *headers]
            defaults = b""
        content = [STATUS_LINE[status_code], defaults]
        has_connection_close = False
        if headers:
            _check(headers)
            for name, value in headers:
                name = name.lower()
                if name in _WATCHED:
                    if name == b"content-length":
                        if self.chunked_encoding is None:
                            self.expected_content_length = int(value.decode())
                            self.chunked_encoding = False
                    elif name == b"transfer-encoding":
                        if value.lower() == b"chunked":
                            self.expected_content_length = 0
                            self.chunked_encoding = True
                    elif b"close" in [token.lower().strip() for token in value.split(b",")]:
                        self.keep_alive = False
                        has_connection_close = True
                content += (name, b": ", value, b"\r\n")
        safe = message.get(EXTENSION)
        if safe:
            content.append(safe)
        unknown_length = self.chunked_encoding is None and self.scope["method"] != "HEAD" and status_code not in (204, 304)
        if unknown_length and self.scope.get("http_version") == "1.0":  # ends with the connection, not chunked
            self.chunked_encoding = False
            self.keep_alive = False
            self._until_close = True
            unknown_length = False
        # Answered before the request's body has come (a 401, a 429): the connection ends with this answer, so
        # its head says so, or a client sends its next request into a closing connection. It is not closed
        # here (uvicorn closes at once when not `keep_alive`): with the body unread, the kernel would answer
        # the client's next bytes with a reset that destroys this answer; the protocol lingers, then closes.
        early = self.more_body and self.ends_early
        if (early or not self.keep_alive) and not has_connection_close:
            content.append(_CLOSE)
        if early and not self._until_close:
            self.keep_alive = True
            self.said_close = True  # (the protocol closes after the answer: GuardedProtocol.on_response_complete)
        if unknown_length:
            self.chunked_encoding = True  # neither content-length nor transfer-encoding given
            content.append(_CHUNKED)
        content.append(b"\r\n")
        self.transport.write(b"".join(content))
