"""Small OpenAI-compatible engines that misbehave on purpose, for gateway tests through real HTTP.

One aiohttp server; the behaviour is the first path segment, so a catalog endpoint
`http://127.0.0.1:PORT/slow` is an engine that streams one chunk every 100 ms. `FakeEngines.state` records
what the engines saw (hits, bodies, concurrency, when a request was cancelled). `frozen()` starts a
separate server that accepts connections and never answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

from aiohttp import web

from llmgw.dev.procs import free_port

UTF8_TEXT = "price: 5 € — happy 😀!"


def chunk(text: str, model: str = "fake") -> bytes:
    event = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": model,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def answer(text: str, body: dict) -> dict:
    return {"id": "c1", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "received": body}


def last_user_text(body: dict) -> str:
    msgs = body.get("messages") or [{"content": body.get("prompt", "")}]
    return str(msgs[-1].get("content", ""))


class FakeEngines:
    def __init__(self) -> None:
        self.state: dict = {"hits": Counter(), "bodies": [], "active": 0, "max_active": 0, "cancelled_at": None,
                            "cancel_started_at": None, "release": asyncio.Event(), "firehose_cancelled": None}
        self.port = free_port()
        self.runner: web.AppRunner | None = None
        self._frozen: list[asyncio.AbstractServer] = []

    def url(self, behaviour: str) -> str:
        return f"http://127.0.0.1:{self.port}/{behaviour}"

    async def start(self) -> "FakeEngines":
        app = web.Application(handler_args={"keepalive_timeout": 75})
        app.router.add_post("/{behaviour}/v1/{kind:.*}", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def frozen(self) -> str:
        """A server that accepts connections and never answers; returns its URL."""
        port = free_port()
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)
        self._frozen.append(server)
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        for s in self._frozen:
            s.close()
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        behaviour, kind = request.match_info["behaviour"], request.match_info["kind"]
        body = await request.json()
        self.state["hits"][behaviour] += 1
        self.state["bodies"].append((behaviour, body))
        fn = getattr(self, "_" + behaviour)
        return await fn(request, body, kind)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    # ---- behaviours -------------------------------------------------------------------------------
    async def _echo(self, request, body, kind):
        if kind == "embeddings":
            return web.json_response({"object": "list", "model": body["model"],
                                      "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                                      "usage": {"prompt_tokens": 1, "total_tokens": 1}})
        text = "echo: " + last_user_text(body)
        if not body.get("stream"):
            out = answer(text, body)
            if kind == "completions":
                out["object"] = "text_completion"
                out["choices"] = [{"index": 0, "text": text, "finish_reason": "stop"}]
            return web.json_response(out)
        resp = await self._sse(request)
        for word in text.split(" "):
            await resp.write(chunk(word + " ", body["model"]))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _trigger(self, request, body, kind):
        said = last_user_text(body)
        if "call a tool" in said or "reason it out" in said:  # the forbidden words in a tool call or reasoning
            field = {"reasoning_content": "a forbidden thought"} if "reason" in said else {"tool_calls": [
                {"index": 0, "id": "t1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "something forbid'}}]}
            if not body.get("stream"):
                out = answer("", body)
                msg = out["choices"][0]["message"]
                msg.update(content=None, **field)
                if "tool_calls" in field:
                    msg["tool_calls"][0]["function"]["arguments"] += 'den"}'
                return web.json_response(out)
            resp = await self._sse(request)
            first = {"choices": [{"index": 0, "delta": field, "finish_reason": None}]}
            rest = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                "arguments": 'den"}'}}]} if "tool_calls" in field else {"content": "done"},
                "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(first).encode() + b"\n\ndata: " + json.dumps(rest).encode()
                             + b"\n\ndata: [DONE]\n\n")
            return resp
        if "trigger" in said:
            if not body.get("stream"):
                return web.json_response(answer("here is a forbidden answer", body))
            resp = await self._sse(request)
            await resp.write(chunk("here is a forbidden answer") + b"data: [DONE]\n\n")
            return resp
        return await self._echo(request, body, kind)

    async def _nodone(self, request, body, kind):
        resp = await self._sse(request)
        await resp.write(chunk("no done marker"))
        return resp

    async def _utf8(self, request, body, kind):
        resp = await self._sse(request)
        data = chunk(UTF8_TEXT) + b"data: [DONE]\n\n"
        euro = data.index("€".encode())
        smile = data.index("😀".encode())
        # Split inside the 3-byte euro sign and inside the 4-byte emoji, with pauses between writes.
        for piece in (data[:euro + 1], data[euro + 1:smile + 2], data[smile + 2:]):
            await resp.write(piece)
            await asyncio.sleep(0.05)
        return resp

    async def _lockstep(self, request, body, kind):
        """One chunk, then wait until the test says it arrived (`state["lockstep"]`), twenty times."""
        resp = await self._sse(request)
        for i in range(20):
            await resp.write(chunk(f"t{i} "))
            try:
                await asyncio.wait_for(self.state["lockstep"].get(), 30)
            except asyncio.TimeoutError:
                break  # the chunk never reached the client: the test fails on the missing chunks
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _cancel(self, request, body, kind):
        """Streams for a minute unless the gateway cancels it (drops the connection)."""
        resp = await self._sse(request)
        self.state["cancel_started_at"] = t0 = time.monotonic()
        try:
            i = 0
            while time.monotonic() - t0 < 60:
                await resp.write(chunk(f"t{i} "))
                await asyncio.sleep(0.05)
                i += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.state["cancelled_at"] = time.monotonic()
            raise
        return resp

    async def _midevent(self, request, body, kind):
        """A complete event, then half of one, then a clean end of the answer."""
        resp = await self._sse(request)
        await resp.write(chunk("partial "))
        await resp.write(b'data: {"id": "c1", "choi')
        return resp

    async def _messy(self, request, body, kind):
        """Fields and lines a client must not see, two [DONE]s, and data after them."""
        resp = await self._sse(request)
        await resp.write(b": keep-alive\n\n")
        await resp.write(b"event: message\n" + chunk("one"))
        await resp.write(b"id: 7\n\n")
        await resp.write(b"garbage line\n\n")
        await resp.write(chunk("two"))
        await resp.write(b"data: [DONE]\n\ndata: [DONE]\n\n")
        await resp.write(b'data: {"after done": 1}\n\n')
        return resp

    async def _shortbody(self, request, body, kind):
        """A JSON answer announced as 1000 bytes, cut after 20."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"id": "c1", "choice')
        await asyncio.sleep(0.05)
        request.transport.abort()
        return resp

    async def _streams_anyway(self, request, body, kind):
        """An event stream for a request that asked for none."""
        resp = await self._sse(request)
        await resp.write(chunk("streamed") + b"data: [DONE]\n\n")
        return resp

    async def _hold(self, request, body, kind):
        """Answers once the test sets `state["release"]` (at most 30 s)."""
        try:
            await asyncio.wait_for(self.state["release"].wait(), 30)
        except asyncio.TimeoutError:
            pass
        return web.json_response(answer("held", body))

    async def _firehose(self, request, body, kind):
        """Streams 64 KiB events as fast as it may write, for a minute, noting when it is cancelled."""
        resp = await self._sse(request)
        event = chunk("x" * 65536)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 60:
                await resp.write(event)
        except (asyncio.CancelledError, ConnectionResetError):
            self.state["firehose_cancelled"] = time.monotonic()
            raise
        return resp

    async def _garbage(self, request, body, kind):
        return web.Response(text="<html>a proxy's error page</html>", content_type="text/html")

    async def _breaks(self, request, body, kind):
        resp = await self._sse(request)
        await resp.write(chunk("partial "))
        await asyncio.sleep(0.1)
        request.transport.abort()  # the engine dies mid-answer
        return resp

    async def _stalls(self, request, body, kind):
        resp = await self._sse(request)
        await resp.write(chunk("partial "))
        await asyncio.sleep(3600)
        return resp

    async def _delay(self, request, body, kind):
        self.state["active"] += 1
        self.state["max_active"] = max(self.state["max_active"], self.state["active"])
        try:
            await asyncio.sleep(0.3)
        finally:
            self.state["active"] -= 1
        return web.json_response(answer("done", body))

    async def _judge(self, request, body, kind):
        said = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return web.json_response(answer("unsafe\nS1" if "forbidden" in said else "safe", body))

    async def _fail500(self, request, body, kind):
        return web.Response(status=500, text="Internal Server Error\nTraceback (most recent call last): ...\n"
                            "FORGED 2099-01-01 INFO llmgw: all is well \x1b[2J fetched https://bucket.example/w.gguf"
                            "?X-Amz-Signature=SECRET-SIG")

    async def _refuse400(self, request, body, kind):
        return web.json_response({"object": "error", "message": "max_tokens is too large", "type": "BadRequestError",
                                  "param": "max_tokens", "code": 400}, status=400)

    async def _unsupported501(self, request, body, kind):  # llama-server asked for embeddings without --embeddings
        return web.json_response({"error": {"code": 501, "message": "This server does not support embeddings. Start "
                                            "it with `--embeddings`", "type": "not_supported_error"}}, status=501)

    async def _traceback501(self, request, body, kind):  # a 501 that is not an engine's chosen words
        return web.Response(status=501, text="Traceback (most recent call last):\n  File \"/srv/secret/engine.py\"\n"
                            "NotImplementedError")

    async def _oddevents(self, request, body, kind):
        """Events of kinds no chat stream has (a named event, a chunk with a delta of an unknown field, a JSON
        array, text that is no JSON), between two real chunks."""
        resp = await self._sse(request)
        await resp.write(b'event: response.mystery\ndata: {"type": "mystery", "x": 1}\n\n')
        await resp.write(chunk("one "))
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"mystery": true}}]}\n\n')
        await resp.write(b"data: [1, 2]\n\ndata: not json\n\n")
        await resp.write(chunk("two"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _afterdone(self, request, body, kind):
        """A stream that says [DONE] and then keeps its connection open with keep-alive comments."""
        resp = await self._sse(request)
        await resp.write(chunk("said ") + b"data: [DONE]\n\n")
        self.state["afterdone_open"] = True
        try:
            for _ in range(600):
                await asyncio.sleep(0.1)
                await resp.write(b": ping\n\n")
        finally:
            self.state["afterdone_open"] = False
        return resp

    async def _huge(self, request, body, kind):
        """An answer as long as the request asks (`huge` in the prompt: 17 MiB, past what is held for a
        response check), else the echo."""
        if "huge" not in last_user_text(body):
            return await self._echo(request, body, kind)
        return web.json_response(answer("x" * (17 << 20), body))

    async def _auth401(self, request, body, kind):  # an engine whose key is not the one the gateway sends
        return web.json_response({"error": {"message": "Invalid API key", "type": "invalid_request_error"}}, status=401)

    async def _busy429(self, request, body, kind):
        return web.json_response({"error": {"message": "too many requests", "type": "rate_limit"}}, status=429)

    async def _busy429wait(self, request, body, kind):  # says how long to wait, in seconds
        return web.json_response({"error": {"message": "too many requests"}}, status=429, headers={"Retry-After": "7"})

    async def _busy429odd(self, request, body, kind):  # a Retry-After the gateway cannot pass on as it is
        value = ["Wed, 21 Oct 2015 07:28:00 GMT", "99999999999", "-3", "soon"][self.state["hits"]["busy429odd"] % 4]
        return web.json_response({"error": {"message": "too many requests"}}, status=429, headers={"Retry-After": value})

    async def _busy503wait(self, request, body, kind):
        return web.json_response({"error": {"message": "loading"}}, status=503, headers={"Retry-After": "12"})

    async def _busy503(self, request, body, kind):
        return web.json_response({"error": {"message": "overloaded", "type": "server_error"}}, status=503)


class RawEngine:
    """An engine written at the byte level, for what aiohttp would never send: a second answer after the
    first, bytes on an idle kept-alive connection, informational (1xx) answers, a 1 MiB header, a stream that
drips then stalls. The
    first path segment picks the behaviour; every answer's content is `answer(N)` where N counts requests."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: asyncio.AbstractServer | None = None
        self.requests = 0
        self.tasks: set[asyncio.Task] = set()

    def url(self, behaviour: str) -> str:
        return f"http://127.0.0.1:{self.port}/{behaviour}"

    async def start(self) -> "RawEngine":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @staticmethod
    def response(text: str, extra_headers: bytes = b"") -> bytes:
        body = json.dumps(answer(text, {})).encode()
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra_headers +
                b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next((ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                                   if ln.lower().startswith(b"content-length:")), b"0"))
                await reader.readexactly(length)
                behaviour = head.split(b" ", 2)[1].split(b"/")[1].decode()
                self.requests += 1
                mine = self.response(f"answer {self.requests}")
                if behaviour == "extra":  # the answer, and at once another nobody asked for
                    writer.write(mine + self.response("smuggled"))
                elif behaviour == "late":  # the answer; a moment later, another on the idle connection
                    writer.write(mine)
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    writer.write(self.response("smuggled"))
                elif behaviour == "informational":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n" + mine)
                elif behaviour == "ctltype":  # a control character in a header the gateway relays
                    writer.write(mine.replace(b"Content-Type: application/json", b"Content-Type: application/json\x01\r\nX-Injected: 1", 1))
                elif behaviour == "obstype":  # bytes above 0x7f: allowed in a header value, relayed as they are
                    writer.write(mine.replace(b"Content-Type: application/json", b"Content-Type: application/json; x=\x80\xff", 1))
                elif behaviour == "bighead":
                    writer.write(self.response("big", b"X-Big: " + b"a" * (1 << 20) + b"\r\n"))
                elif behaviour in ("drip", "dripstall"):  # a chunk every 0.1 s, 8 of them; then the end, or silence
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(8):
                        event = b"data: {\"n\": %d}\n\n" % i
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                        await asyncio.sleep(0.1)
                    if behaviour == "dripstall":
                        await asyncio.sleep(3600)
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(mine)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()
