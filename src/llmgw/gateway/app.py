"""The OpenAI-compatible gateway: `Gateway` (what the process holds) and `create_gateway_app()` (the ASGI
app served on :8080).

POST /v1/chat/completions, /v1/completions and /v1/embeddings go straight to the `Proxy` (the hot path), and
so do Anthropic's POST /v1/messages and OpenAI's POST /v1/responses, served as chat completions
(gateway/messages.py, gateway/responses.py; their errors in their own envelopes); everything else (`/v1/models`, `/healthz`, `/metrics`, the chat page) is a FastAPI app. Every `/v1/` path
checks the API key first (gateway/keys.py `KeyRing`); `/healthz`, `/metrics` and the chat page do not. A key
that belongs to a tenant or has limits is accounted (gateway/quotas.py): its requests per minute and
budgets are checked as the headers arrive, before the body is read (401 and 429 are answered without
reading it, and the listener then closes the connection), then the proxy admits, counts and limits its
requests, and `/v1/models` lists only the models it may use.
Every error, FastAPI's included, is rendered in the OpenAI envelope (http/errors.py).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.config import Settings
from llmgw.db import status_repo
from llmgw.http import errors
from llmgw.gateway.admission import Gates
from llmgw.gateway.engine_queues import EngineQueues
from llmgw.gateway.adapters import AdapterLoads
from llmgw.gateway.balancer import Balancer
from llmgw.gateway.demand import Demand
from llmgw.gateway.isolation import Isolation, Salts, salt_secret
from llmgw.gateway.drain import Drain
from llmgw.http.errors import install_error_handlers, send_error
from llmgw.db.feed import ChangeFeed
from llmgw.gateway.openai_api import REQUIRED
from llmgw.gateway.proxy import Proxy
from llmgw.gateway.quotas import Quotas
from llmgw.gateway.routes import TABLES, RouteTable
from llmgw.gateway.upstream import Upstream
from llmgw.placement.model_status import ModelCondition, client_reason
from llmgw.schemas.catalog import Adapter, Model
from llmgw.gateway.keys import KeyRing
from llmgw.security.api_keys import api_token
from llmgw.gateway.batches import OWNER, batch_identity, files_and_batches, owner_of
from llmgw.gateway.messages import MessagesDoor
from llmgw.gateway.responses import ResponsesDoor
from llmgw.security.batch_token import batch_secret
from llmgw.security.logtext import for_client
from llmgw.telemetry import GatewayMetrics
from llmgw.temporal import LazyClient
from llmgw.version import VERSION

log = logging.getLogger(__name__)
DOORS = {d.path: d for d in (MessagesDoor, ResponsesDoor)}  # other APIs served as chat completions
COUNT_TOKENS = "/v1/messages/count_tokens"
STATIC = Path(__file__).parent / "static"
ACCOUNT = "llmgw.account"  # the scope key that carries an accounted key's Account to the FastAPI routes


def model_object(m: Model, cond: ModelCondition | None = None, created: int = 0) -> dict:
    """A model as /v1/models lists it; `owned_by: llmgw-sim` when every profile is simulated (seeds 003).
    `llmgw` (an extension OpenAI clients ignore) carries its status for the chat page and for clients that
    want to know before asking: `status` (ready, loading, on demand, failing, ...), `reason`, and while
    failing `restarts`, `retry_in_s` and `on_request` (its next start waits for a request;
    placement/model_status.py). The reason names no URL, path or address of the fleet (`for_client`), and
    never quotes an engine's output (`client_reason`: it may hold a logged prompt).
    `created`: when the model was first applied (Unix seconds, OpenAI's field); `llmgw.aliases`: the other
    names a request may use for it."""
    out: dict = {"id": m.name, "object": "model", "created": created,
                 "owned_by": "llmgw-sim" if m.simulated else "llmgw"}
    if cond is not None:
        out["llmgw"] = {"status": cond.status.value, "reason": for_client(client_reason(cond)), "restarts": cond.restarts,
                        "retry_in_s": cond.retry_in_s, "on_request": cond.on_request, "aliases": list(m.aliases)}
    return out


def adapter_object(base: Model, adapter: Adapter, created: int = 0) -> dict:
    """A LoRA adapter as /v1/models lists it: vLLM's card (`parent`: its base model; `root`, the source, is
    left out: a path on the fleet's nodes)."""
    return {"id": adapter.name, "object": "model", "created": created,
            "owned_by": "llmgw-sim" if base.simulated else "llmgw", "parent": base.name}


class Gateway:
    """Everything the gateway process holds: route table, keys, limits, proxy, Temporal client, demand."""

    def __init__(self, settings: Settings, engine: AsyncEngine):
        self.settings = settings
        self.engine = engine
        self.routes = RouteTable(engine, settings.node_unreachable_after_s, settings.poller_grace_s,
                                 settings.max_prompt_chars)
        self.metrics = GatewayMetrics()
        self.quotas = Quotas(engine, self.metrics, settings.usage_sync_s, settings.test_budget_day_s)
        self.keys = KeyRing(engine, settings.require_api_key, self.quotas)
        self.gates = Gates()
        self.routes.on_refresh.append(self.gates.sync)
        self.routes.on_refresh.append(self.quotas.catalog_changed)
        self.routes.on_refresh.append(lambda catalog: self.metrics.forget(
            {n for m in catalog.models for n in (m.name, *(a.name for a in m.adapters))}))  # (adapters: labels too)
        self.feed = ChangeFeed(settings.require_database_url(), settings.route_refresh_s)
        self.feed.subscribe("routes", TABLES, self.routes.refresh, partial=True)
        self.routes.ask_refresh = lambda: self.feed.changed("catalog_models")
        self.feed.subscribe("keys", {"api_keys", "tenants"}, self.keys.refresh)
        self.temporal = LazyClient(settings)
        # Load for the planner: in flight and held for a load. Not the requests queued for a slot under a
        # model's `limits.max_concurrency`: that cap is per gateway, so no replica added would drain them
        # (and a scale-up for them could evict another model for nothing).
        self.demand = Demand(engine, self.routes, self.temporal, settings.load_wait_s)
        self.upstream = Upstream(settings.upstream_timeout_s)
        isolation = Isolation(Salts(salt_secret(settings.cache_salt_secret, settings.database_url)),
                              lambda: self.keys.tenanted)
        self.batch_secret = batch_secret(settings.cache_salt_secret, settings.database_url)
        self.drain = Drain(settings.gateway_drain_timeout_s)
        self.drain.on_drain.append(self.demand.draining.set)
        self.engine_queues = EngineQueues(self.routes, self.gates, self.upstream, settings.engine_queue_poll_s)
        self.proxy = Proxy(self.routes, self.demand, self.gates,
                           Balancer(settings.breaker_failures, settings.breaker_open_s), self.upstream, self.metrics,
                           max_body=settings.max_request_bytes, quotas=self.quotas, isolation=isolation,
                           adapters=AdapterLoads(engine, self.upstream, settings.adapter_load_timeout_s))
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.temporal.start()
        await self.feed.start()
        self._tasks.append(asyncio.create_task(self.demand.flush_loop(), name="usage"))
        self._tasks.append(asyncio.create_task(self.quotas.sync_loop(), name="quotas"))
        self._tasks.append(asyncio.create_task(self.engine_queues.loop(), name="engine-queues"))

    def _slots(self, name: str) -> int | None:
        """`name`'s slots on this gateway now, when its gate has a bound (gateway/engine_queues.py)."""
        gate = self.gates.get(name)
        return gate.max_concurrency if gate is not None and gate.max_concurrency < 1 << 30 else None

    def _queued(self, name: str) -> int:
        """Requests waiting for a slot under `name`'s limits on this gateway."""
        gate = self.gates.get(name)
        return gate.queued if gate else 0

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.demand.forget()
        await self.quotas.close()
        await self.feed.close()
        await self.upstream.close()
        await self.temporal.close()

    def scrape(self) -> bytes:
        """The metrics page, with the route-table gauges filled in at scrape time."""
        now = asyncio.get_running_loop().time()
        for name, r in self.routes.models.items():
            self.metrics.route_gauges(name, len(r.endpoints), sum(1 for e in r.endpoints if not self.proxy.balancer.usable(e, now)),
                                      self._queued(name) + self.demand.waiting.get(name, 0), self._slots(name))
        return self.metrics.render()


def create_gateway_app(gw: Gateway):
    """The ASGI app: the hot path for inference, FastAPI for the rest, the API key checked on /v1/."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    api = FastAPI(title="llmgw gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    install_error_handlers(api, "the gateway")

    async def listing(names: list[str] | None = None) -> tuple[dict[str, ModelCondition], dict[str, int]]:
        """Each model's condition, and when it was first applied (Unix seconds)."""
        try:
            async with gw.engine.connect() as conn:
                conds = await status_repo.model_conditions(conn, gw.routes.catalog, names)
                created = await status_repo.catalog_created(conn)
            return conds, {n: int(t.timestamp()) for n, t in created.items()}
        except Exception:  # noqa: BLE001 - the list without statuses is still the list
            log.exception("reading model statuses failed")
            return {}, {}

    @api.get("/v1/models")
    async def list_models(request: Request):
        account = request.scope.get(ACCOUNT)
        models = [m for m in gw.routes.catalog.models if account is None or account.refusing(m) is None]
        conds, times = await listing()
        tenant = account.tenant if account is not None else None
        return {"object": "list", "data": [obj for m in models for obj in (
            model_object(m, conds.get(m.name), times.get(m.name, 0)),
            *(adapter_object(m, a, times.get(m.name, 0)) for a in m.adapters if a.allows(tenant)))]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        route = await gw.routes.lookup(model_id)
        account = request.scope.get(ACCOUNT)
        found = gw.routes.adapter(model_id) if route is None else None
        if found is not None:  # a LoRA adapter: its base's access, then its own tenants
            base, adapter = found
            refusing = account.refusing(base.model) if account is not None else None
            if refusing is not None:
                raise errors.model_not_allowed(base.model.name, refusing.who, refusing.limits.models or [])
            if not adapter.allows(account.tenant if account is not None else None):
                raise errors.adapter_not_allowed(adapter.name, account.tenant if account is not None else None)
            _, times = await listing([base.model.name])
            return adapter_object(base.model, adapter, times.get(base.model.name, 0))
        if route is None:
            usable = (lambda m: account.refusing(m) is None) if account is not None else None
            raise errors.model_not_found(model_id, gw.routes.similar(model_id, usable))
        refusing = account.refusing(route.model) if account is not None else None
        if refusing is not None:
            raise errors.model_not_allowed(route.model.name, refusing.who, refusing.limits.models or [])
        conds, times = await listing([route.model.name])
        return model_object(route.model, conds.get(route.model.name), times.get(route.model.name, 0))

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        raise errors.APIError(404, "this gateway stores no responses (`store` is ignored), so none can be read "
                              "back; keep the Response object the POST returned", code="response_not_stored")

    api.include_router(files_and_batches(gw))

    @api.get("/healthz")
    async def health():
        """Liveness: 200 while the process runs, draining included."""
        return {"status": "ok", "models": len(gw.routes.models), "version": VERSION, "draining": gw.drain.draining}

    @api.get("/readyz")
    async def ready():
        """Readiness, for a load balancer: 200 `ready`, or 503 `draining` from SIGTERM on (gateway/drain.py)."""
        state = {**gw.drain.state(), "version": VERSION}
        return JSONResponse(state, status_code=503 if gw.drain.draining else 200)

    @api.get("/metrics")
    async def metrics():
        return Response(gw.scrape(), media_type="text/plain; version=0.0.4")

    @api.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    proxy = gw.proxy
    keys = gw.keys
    quotas = gw.quotas
    gw_metrics = gw.metrics
    drain = gw.drain
    secret = gw.batch_secret

    async def serve(scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            if path.startswith("/v1/"):
                door = DOORS.get(path)
                anthropic = path.startswith("/v1/messages")
                if (batch := batch_identity(scope["headers"], secret)) is not None:
                    await serve_batch(scope, receive, send, batch)
                    return
                account = keys.lookup(scope["headers"])
                if account is False:
                    gw_metrics.unauthorized()
                    err = errors.unauthorized(sent=api_token(scope["headers"]) is not None)
                    await send_error(send, err, body=MessagesDoor.error_body(err) if anthropic else None)
                    return
                if path in REQUIRED or door is not None or path == COUNT_TOKENS:
                    if scope["method"] != "POST":
                        err = errors.method_not_allowed(scope["method"], path, "POST")
                        await send_error(send, err, body=MessagesDoor.error_body(err) if anthropic else None)
                    elif account is not None and (refused := quotas.refusal(account)) is not None:
                        # before the body: the listener closes after it
                        await send_error(send, refused, body=MessagesDoor.error_body(refused) if anthropic else None)
                    elif path == COUNT_TOKENS:
                        await proxy.count_tokens(receive, send, account)
                    else:
                        await proxy.handle(scope, receive, send, account, door() if door is not None else None)
                    return
                if account is not None:
                    scope[ACCOUNT] = account
                if path.startswith(("/v1/files", "/v1/batches")):
                    scope[OWNER] = owner_of(keys.identify(scope["headers"]))  # (not False: lookup allowed it)
        await api(scope, receive, send)

    async def serve_batch(scope, receive, send, batch) -> None:
        """A request of a batch (gateway/batches.py): as the key that made the batch, in the batch band. Its
        key revoked, or a token that does not verify: 401."""
        path = scope["path"]
        key_id = batch[1] if batch is not False else None
        if batch is False or (key_id and key_id not in keys.by_id) or (path not in REQUIRED and path not in DOORS):
            gw_metrics.unauthorized()
            await send_error(send, errors.unauthorized())
            return
        account = keys.by_id.get(key_id) if key_id else None
        if account is not None and (refused := quotas.refusal(account)) is not None:
            await send_error(send, refused)
            return
        door = DOORS.get(path)
        await proxy.handle(scope, receive, send, account, door() if door is not None else None, batch=True)

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await drain(serve, scope, receive, send)  # counted while open; refused once draining (drain.py)
        else:
            await serve(scope, receive, send)

    app.fastapi = api  # type: ignore[attr-defined]
    return app
