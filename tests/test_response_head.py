"""llmgw/http/response_head.py: `HeadCycle` writes every response head byte for byte as uvicorn's cycle does and
keeps the same state, refuses what uvicorn refuses, and writes the `llmgw.head` lines; through a real
listener, an answer carries them, and a request's scope offers the extension."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmgw.dev.procs import free_port
from llmgw.http.response_head import EXTENSION, HeadCycle, head_lines
from llmgw.http.serving import Listener, serve

DATE = [(b"date", b"Tue, 01 Dec 2026 23:59:59 GMT"), (b"server", b"uvicorn")]


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)


class _Flow:
    write_paused = False


def _cycle(cls, method: str = "POST", keep_alive: bool = True, defaults=None):
    log = logging.getLogger("test")
    return cls(scope={"type": "http", "method": method}, transport=_Transport(), flow=_Flow(), logger=log,
               access_logger=log, access_log=False, default_headers=DATE if defaults is None else defaults,
               message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
               on_response=lambda: None)


def _state(c) -> tuple:
    return (b"".join(c.transport.out), c.keep_alive, c.chunked_encoding, c.expected_content_length,
            c.response_started, c.waiting_for_100_continue)


CASES = [
    (200, []),
    (200, [(b"content-type", b"application/json")]),
    (200, [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache")]),
    (200, [(b"content-length", b"5")]),
    (200, [(b"content-length", b"5"), (b"content-length", b"7")]),
    (200, [(b"Transfer-Encoding", b"Chunked")]),
    (200, [(b"transfer-encoding", b"gzip")]),
    (200, [(b"content-length", b"3"), (b"transfer-encoding", b"chunked")]),
    (200, [(b"connection", b"keep-alive, Close")]),
    (200, [(b"connection", b"keep-alive")]),
    (204, []),
    (304, [(b"etag", b'"x"')]),
    (404, [(b"x-empty", b"")]),
    (599, [[b"x-list", b"lists are headers too"]]),
]


@pytest.mark.parametrize("method", ["POST", "HEAD"])
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("defaults", [DATE, [], [(b"connection", b"close")], [(b"content-length", b"0")]])
@pytest.mark.parametrize("status,headers", CASES)
def test_head_matches_uvicorn(status, headers, method, keep_alive, defaults):
    async def run(cls):
        c = _cycle(cls, method, keep_alive, defaults)
        await c.send({"type": "http.response.start", "status": status, "headers": list(headers)})
        return _state(c)

    assert asyncio.run(run(HeadCycle)) == asyncio.run(run(RequestResponseCycle))


@pytest.mark.parametrize("headers,error", [
    ([(b"x-ok", b"1"), (b"bad name", b"v")], "Invalid HTTP header name."),
    ([(b"x-a\x00", b"v")], "Invalid HTTP header name."),
    ([(b"x-ok", b"1"), (b"x-split", b"a\r\nx-injected: 1")], "Invalid HTTP header value."),
    ([(b"x-nul", b"a\x00b")], "Invalid HTTP header value."),
    ([(b"x-del", b"\x7f")], "Invalid HTTP header value."),
])
def test_bad_headers_are_refused_as_uvicorn_refuses_them(headers, error):
    for cls in (HeadCycle, RequestResponseCycle):
        c = _cycle(cls)
        with pytest.raises(RuntimeError, match=error):
            asyncio.run(c.send({"type": "http.response.start", "status": 200, "headers": headers}))
        assert b"x-injected" not in b"".join(c.transport.out)


def test_a_bad_default_header_is_refused_on_every_answer():
    for _ in range(2):  # not remembered as checked after the first refusal
        c = _cycle(HeadCycle, defaults=[(b"server", b"a\nb")])
        with pytest.raises(RuntimeError, match="Invalid HTTP header value."):
            asyncio.run(c.send({"type": "http.response.start", "status": 200, "headers": []}))


def test_safe_lines_follow_the_headers_and_the_body_is_uvicorns():
    lines = b"x-ratelimit-limit-requests: 10\r\nx-ratelimit-remaining-requests: 9\r\n"

    async def run():
        c = _cycle(HeadCycle)
        await c.send({"type": "http.response.start", "status": 200,
                      "headers": [(b"content-type", b"application/json")], EXTENSION: lines})
        await c.send({"type": "http.response.body", "body": b"{}", "more_body": False})
        return b"".join(c.transport.out)

    out = asyncio.run(run())
    assert out == (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 23:59:59 GMT\r\nserver: uvicorn\r\n"
                   b"content-type: application/json\r\n" + lines +
                   b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert head_lines(lines) == [(b"x-ratelimit-limit-requests", b"10"), (b"x-ratelimit-remaining-requests", b"9")]


def test_a_real_listener_offers_the_extension_and_writes_the_lines():
    """Through uvicorn with llmgw's protocol: the scope says the server takes the lines, and they arrive."""
    seen: list[dict] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(dict(scope.get("extensions") or {}))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")],
                    EXTENSION: b"x-ratelimit-remaining-tokens: 41\r\n"})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        port = free_port()
        stop = asyncio.Event()
        server = asyncio.create_task(serve([Listener(app, "127.0.0.1", port, "test", lifespan="off")], stop))
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(200):
                    try:
                        r = await client.get(f"http://127.0.0.1:{port}/")
                        break
                    except httpx.ConnectError:
                        await asyncio.sleep(0.02)
                r2 = await client.get(f"http://127.0.0.1:{port}/again")  # the same connection, kept alive
            return r, r2
        finally:
            stop.set()
            await server

    r, r2 = asyncio.run(main())
    for resp in (r, r2):
        assert resp.status_code == 200 and resp.text == "ok"
        assert resp.headers["x-ratelimit-remaining-tokens"] == "41"
        assert resp.headers["content-type"] == "text/plain"
    assert all(EXTENSION in ext for ext in seen) and len(seen) == 2


def test_a_stream_to_an_http_1_0_client_ends_with_the_connection_not_chunked():
    """A body of unknown length (a stream) to an HTTP/1.0 request: no `transfer-encoding: chunked`, which
    such a client cannot read, but `connection: close`, the events as they are, and the connection closed
    at the end of the body. Over HTTP/1.1 the same messages are chunked exactly as uvicorn chunks them."""
    events = [b"data: {\"a\": 1}\n\n", b"", b"data: [DONE]\n\n"]

    async def run(cls, version: str):
        c = _cycle(cls)
        c.scope["http_version"] = version
        closed: list[bool] = []
        c.transport.close = lambda: closed.append(True)
        c.on_response = lambda: closed.append(False)
        await c.send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, e in enumerate(events):
            await c.send({"type": "http.response.body", "body": e, "more_body": i < len(events) - 1})
        with pytest.raises(RuntimeError, match="after response already completed"):
            await c.send({"type": "http.response.body", "body": b"late"})
        return b"".join(c.transport.out), closed, c.response_complete, c.keep_alive

    raw, closed, complete, keep_alive = asyncio.run(run(HeadCycle, "1.0"))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head and head.endswith(b"\r\nconnection: close"), head
    assert body == b"".join(events) and complete and not keep_alive
    assert closed == [True, False]  # the transport closed (the end of the body), then the cycle finished
    assert asyncio.run(run(HeadCycle, "1.1"))[0] == asyncio.run(run(RequestResponseCycle, "1.1"))[0]
    assert b"transfer-encoding: chunked" in asyncio.run(run(HeadCycle, "1.1"))[0]
