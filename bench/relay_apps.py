"""Minimal relays the gateway's hot path was chosen against (run by relays.py, one process each):

- `fastapi-httpx`: a FastAPI route relaying with httpx (the habitual choice);
- `fastapi-aiohttp`: the same route relaying with aiohttp's client;
- `asgi-aiohttp`: a bare ASGI app relaying with aiohttp's client;
- `asgi-llmgw`: a bare ASGI app relaying with llmgw's own client (llmgw/gateway/upstream.py).

Each reads the body, POSTs it upstream, and answers with the upstream's status, content type and body.
Nothing else: no routing, keys, limits or metrics, so each row is the floor for its design.

Run: `python bench/relay_apps.py KIND PORT UPSTREAM_URL asyncio|uvloop`.
"""

import sys
from contextlib import asynccontextmanager

import uvicorn


async def _body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


def _lifespan_asgi(handler, startup, shutdown):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await startup()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await handler(scope, receive, send)
    return app


def fastapi_app(upstream: str, client_kind: str):
    from fastapi import FastAPI, Request, Response

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        if client_kind == "httpx":
            import httpx
            state["c"] = httpx.AsyncClient(timeout=60)
        else:
            import aiohttp
            state["c"] = aiohttp.ClientSession()
        yield
        await (state["c"].aclose() if client_kind == "httpx" else state["c"].close())

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.body()
        if client_kind == "httpx":
            r = await state["c"].post(upstream, content=body, headers={"Content-Type": "application/json"})
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        async with state["c"].post(upstream, data=body, headers={"Content-Type": "application/json"}) as r:
            return Response(await r.read(), status_code=r.status, media_type=r.headers.get("content-type"))

    return app


def asgi_aiohttp(upstream: str):
    import aiohttp

    state: dict = {}

    async def startup():
        state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def shutdown():
        await state["s"].close()

    async def handler(scope, receive, send):
        body = await _body(receive)
        async with state["s"].post(upstream, data=body, headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
            ctype = r.headers.get("Content-Type", "application/json").encode()
        await send({"type": "http.response.start", "status": r.status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": data})

    return _lifespan_asgi(handler, startup, shutdown)


def asgi_llmgw(upstream: str):
    from llmgw.gateway.upstream import Upstream, parse_target

    base, _, path = upstream.partition("/v1/")
    target, path = parse_target(base), "/v1/" + path
    state: dict = {}

    async def startup():
        state["u"] = Upstream(60)

    async def shutdown():
        await state["u"].close()

    async def handler(scope, receive, send):
        body = await _body(receive)
        resp = await state["u"].post(target, path, body)
        data = await resp.read()
        ctype = resp.header(b"content-type") or b"application/json"
        status = resp.status
        resp.release()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": data})

    return _lifespan_asgi(handler, startup, shutdown)


def main() -> None:
    kind, port, upstream, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    app = {"fastapi-httpx": lambda: fastapi_app(upstream, "httpx"),
           "fastapi-aiohttp": lambda: fastapi_app(upstream, "aiohttp"),
           "asgi-aiohttp": lambda: asgi_aiohttp(upstream),
           "asgi-llmgw": lambda: asgi_llmgw(upstream)}[kind]()
    uvicorn.run(app, host="127.0.0.1", port=port, loop=loop, http="httptools", log_level="warning",
                access_log=False, proxy_headers=False)


if __name__ == "__main__":
    main()
