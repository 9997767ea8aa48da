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
                            "cancel_started_at": None}
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
        if "trigger" in last_user_text(body):
            return web.json_response(answer("here is a forbidden answer", body))
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

    async def _slow(self, request, body, kind):
        resp = await self._sse(request)
        for i in range(20):
            await resp.write(chunk(f"t{i} "))
            await asyncio.sleep(0.1)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _cancel(self, request, body, kind):
        resp = await self._sse(request)
        self.state["cancel_started_at"] = time.monotonic()
        try:
            for i in range(200):
                await resp.write(chunk(f"t{i} "))
                await asyncio.sleep(0.05)
        except (asyncio.CancelledError, ConnectionResetError):
            self.state["cancelled_at"] = time.monotonic()
            raise
        return resp

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
        return web.Response(status=500, text="Internal Server Error\nTraceback (most recent call last): ...")

    async def _refuse400(self, request, body, kind):
        return web.json_response({"object": "error", "message": "max_tokens is too large", "type": "BadRequestError",
                                  "param": "max_tokens", "code": 400}, status=400)

    async def _busy503(self, request, body, kind):
        return web.json_response({"error": {"message": "overloaded", "type": "server_error"}}, status=503)
