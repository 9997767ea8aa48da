"""The OpenAI-compatible gateway: `create_gateway_app()` returns the ASGI app served on :8080.

POST /v1/chat/completions, /v1/completions and /v1/embeddings go straight to the `Proxy` (the hot
path); everything else (`/v1/models`, `/healthz`, `/metrics`, the chat page) is a FastAPI app.
"""

from __future__ import annotations

import asyncio
import logging
import math
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.config import Settings
from llmgw.db import catalog_repo
from llmgw.gateway import errors
from llmgw.gateway.errors import APIError
from llmgw.gateway.proxy import REQUIRED, Proxy
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.schemas.catalog import Model
from llmgw.telemetry import GatewayMetrics
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


def model_object(m: Model) -> dict:
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "llmgw-sim" if m.simulated else "llmgw"}


def json_error(err: APIError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content={"error": {"message": err.message, "type": err.type,
                        "param": err.param, "code": err.code}}, headers=err.headers)


class Gateway:
    """Everything the gateway process holds: route table, proxy, Temporal client, usage flusher."""

    def __init__(self, settings: Settings, engine: AsyncEngine, load_wait_s: float = 5.0):
        self.settings = settings
        self.engine = engine
        self.load_wait_s = load_wait_s
        self.routes = RouteTable(engine, settings.require_database_url(), settings.node_unreachable_after_s,
                                 settings.route_refresh_s)
        self.metrics = GatewayMetrics()
        self.proxy = Proxy(self.routes, self.on_missing, metrics=self.metrics)
        self.temporal = LazyClient(settings)
        self._last_demand: dict[str, float] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.temporal.start()
        await self.routes.start()
        await self.proxy.start()
        self._tasks.append(asyncio.create_task(self._flush_usage(), name="usage"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.proxy.close()
        await self.routes.close()
        await self.temporal.close()

    async def on_missing(self, route: ModelRoute, asked: str) -> ModelRoute:
        """No Ready replica: ask for a load when the model may run, wait briefly, else 503 + Retry-After.

        Seeds 003 ("Load a model when someone asks for it"): refusing makes on-demand useless, waiting
        without bound turns a request into a job; so wait `load_wait_s`, then say the model is loading.
        """
        model = route.model
        sc = model.effective_scaling
        if not model.profiles:
            raise errors.unavailable(model.name, "none of its endpoints is reachable")
        if sc.off:
            raise errors.unavailable(model.name, "it is switched off in the catalog (scaling max 0)", retry_after_s=60)
        loop = asyncio.get_running_loop()
        if sc.on_demand and loop.time() - self._last_demand.get(model.name, -math.inf) > 2.0:
            self._last_demand[model.name] = loop.time()
            async with self.engine.begin() as conn:
                await catalog_repo.record_demand(conn, model.name)
            await self.temporal.wake(f"demand for {model.name}")
        ready = await self.routes.wait_for_endpoint(model.name, self.load_wait_s)
        if ready and ready.endpoints:
            return ready
        raise errors.loading(model.name, retry_after_s=10)

    async def _flush_usage(self) -> None:
        """Every second, mark models used now (requests in flight or just ended): the idle clock starts
        when the last request ends, so a busy model is never stopped for idleness."""
        while True:
            await asyncio.sleep(1.0)
            names = self.proxy.usage.take()
            if not names:
                continue
            try:
                async with self.engine.begin() as conn:
                    for n in names:
                        await catalog_repo.record_use(conn, n)
            except Exception:  # noqa: BLE001 - next tick retries; log and count
                log.exception("recording model use failed")


def create_gateway_app(gw: Gateway):
    """The ASGI app: the hot path for inference, FastAPI for the rest."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    api = FastAPI(title="llmgw gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    @api.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return json_error(exc)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return json_error(APIError(404, f"no such route: {request.method} {request.url.path}", code="not_found"))
        if exc.status_code == 405:
            return json_error(APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"))
        return json_error(APIError(exc.status_code, str(exc.detail)))

    @api.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return json_error(errors.bad_request(first.get("msg", "invalid request"), param=param))

    @api.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_object(m) for m in gw.routes.catalog.models]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        route = gw.routes.resolve(model_id)
        if route is None:
            raise errors.model_not_found(model_id)
        return model_object(route.model)

    @api.get("/healthz")
    async def health():
        return {"status": "ok", "models": len(gw.routes.models)}

    @api.get("/metrics")
    async def metrics():
        for name, r in gw.routes.models.items():
            gw.metrics.ready.labels(name).set(len(r.endpoints))
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in REQUIRED:
            await gw.proxy(scope, receive, send)
        else:
            await api(scope, receive, send)

    app.fastapi = api  # type: ignore[attr-defined]
    return app
