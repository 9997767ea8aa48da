"""The OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`, one shape for every error.

Nothing expected is ever a 500, and no body ever carries a traceback. Statuses: 400 a bad request (naming
the field in `param`), 401 no valid API key, 403 a model the key may not use, 404 unknown model or route,
405 wrong method, 413 body too large, 429 the model's queue is full, or a tenant's or key's limit is
reached (`rate_limit_exceeded`; `insufficient_quota` for a spent budget), 502 the engine failed, 503
loading / unavailable / queued too long (with Retry-After; `code` says which: model_loading only while a
replica is starting, model_failing while its starts fail and it backs off, model_pending,
model_unplaceable, ...), 504 the engine did not answer in time.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Awaitable, Callable

from llmgw.security.logtext import for_client

log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]  # an ASGI send

if TYPE_CHECKING:
    from llmgw.catalog.context import PromptBound


class APIError(Exception):
    """An error a client should see. `status` is the HTTP status; `type` the OpenAI error type."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str, similar: str | None = None) -> APIError:
    """OpenAI's 404 for an unknown model, with the name the caller most likely meant (one it may use) and
    where to find the rest."""
    hint = f" Did you mean `{similar}`?" if similar else ""
    return APIError(404, f"The model `{name}` does not exist or you do not have access to it.{hint} "
                    "GET /v1/models lists the models you can use.", code="model_not_found", param="model")


def loading(name: str, retry_after_s: int, detail: str | None = None) -> APIError:
    why = f" ({detail})" if detail else ""
    return APIError(503, f"the model `{name}` is loading{why}; retry in about {retry_after_s}s",
                    type="service_unavailable", code="model_loading", headers={"Retry-After": str(retry_after_s)})


def failing(name: str, cause: str, retry_after_s: int, restarts: int) -> APIError:
    """Its starts keep failing and it is backing off (a CrashLoopBackOff): not "loading", which a client
    would retry in seconds for minutes. Retry-After is the backoff left. `cause` is the client's version
    (placement/model_status.py `client_reason`: never an engine's output); it names no URL, path or address
    of the fleet (`for_client`)."""
    first = cause.strip().splitlines()[0] if cause.strip() else "no cause recorded"
    return APIError(503, f"the model `{name}` is failing: its replicas failed {restarts} time(s) in a row (starting "
                    f"or running), the last with: {for_client(first)}; "
                    f"the next start is in about {retry_after_s}s (an operator runs `llmgw ctl retry {name}` once the "
                    f"cause is fixed)", type="service_unavailable", code="model_failing",
                    headers={"Retry-After": str(max(1, retry_after_s))})


def pending(name: str, retry_after_s: int = 5) -> APIError:
    """Wanted but no replica is starting yet (the control plane has not placed one): not "loading"."""
    return APIError(503, f"the model `{name}` has no replica starting yet; the control plane has been asked for one "
                    f"(`llmgw ctl explain {name}` says why it is not placed)", type="service_unavailable",
                    code="model_pending", headers={"Retry-After": str(retry_after_s)})


def unplaceable(name: str, why: str) -> APIError:
    """No node can take the model now (the reconciler's latest pass refused it): not "loading"."""
    return APIError(503, f"the model `{name}` cannot be started now: {for_client(why)} (`llmgw ctl explain {name}` "
                    "says more)",
                    type="service_unavailable", code="model_unplaceable", headers={"Retry-After": "60"})


def unavailable(name: str, why: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, f"the model `{name}` is not available: {why}", type="service_unavailable",
                    code="model_unavailable", headers={"Retry-After": str(retry_after_s)})


def draining(retry_after_s: int = 1) -> APIError:
    """503: this gateway is shutting down (SIGTERM, gateway/drain.py); another gateway takes the request."""
    return APIError(503, "this gateway is shutting down; retry the request (another gateway will answer it)",
                    type="service_unavailable", code="gateway_draining", headers={"Retry-After": str(retry_after_s)})


def drain_timeout(seconds: float) -> APIError:
    """The answer was still open when this gateway's drain ran out (`gateway_drain_timeout_s`): the error event
    that ends the stream, or a 503 when nothing of the answer was sent yet."""
    return APIError(503, f"this gateway shut down before the answer was complete (it waited {seconds:g}s); "
                    "retry the request", type="service_unavailable", code="gateway_draining",
                    headers={"Retry-After": "1"})


def answer_too_large(limit: int) -> APIError:
    """502: the engine's answer to this request is longer than the gateway holds whole. The request asked for
    it (thousands of embedding inputs, `n: 128`), so it says what to ask instead, and the replica is not
    counted as failing (any client could take a model's replicas out of routing this way)."""
    return APIError(502, f"the answer is longer than {limit >> 20} MiB, the most the gateway reads whole; ask for "
                    "less in one request (fewer inputs, a smaller n or max_tokens, or stream it)",
                    type="upstream_error", code="answer_too_large")


def not_text(param: str) -> APIError:
    """400: a guarded model's prompt the guard cannot read (token ids): it would reach the engine unjudged."""
    return APIError(400, f"`{param}` must be text for this model: its guard judges every prompt, and token ids "
                    "cannot be judged; send the prompt as a string or a list of strings", param=param,
                    code="invalid_prompt")


def upstream_failed(why: str) -> APIError:
    return APIError(502, f"the engine failed: {why}", type="upstream_error", code="engine_error")


def upstream_timeout(seconds: float) -> APIError:
    return APIError(504, f"the engine did not answer within {seconds:g}s", type="upstream_error", code="engine_timeout")


def unauthorized(sent: bool = False) -> APIError:
    """401. `sent`: the request carried a key, and it is not one the gateway knows (mistyped, revoked, or of
    another deployment); else it carried none that could be read."""
    if sent:
        why = ("the API key sent is not valid here (mistyped, revoked, or not this gateway's): send "
               "`Authorization: Bearer <key>` with a key from `llmgw ctl keys create`")
    else:
        why = ("a valid API key is required: send `Authorization: Bearer <key>` (keys come from "
               "`llmgw ctl keys create`)")
    return APIError(401, why, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def method_not_allowed(method: str, path: str, allow: str) -> APIError:
    return APIError(405, f"{method} is not allowed on {path}; use {allow}", code="method_not_allowed",
                    headers={"Allow": allow})


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def prompt_too_long(name: str, chars: int, bound: PromptBound, param: str) -> APIError:
    """400: the prompt's text is longer than the model's prompt bound (catalog/context.py `PromptBound`).
    OpenAI's code, which clients that trim a conversation to fit recognise."""
    why = (f"its context is {bound.context:,} tokens a request" if bound.context is not None
           else "its `limits.max_prompt_chars`" if bound.source == "limits.max_prompt_chars"
           else "the gateway's `max_prompt_chars`")
    where = (f"`{param}` holds" if param in ("messages", "prompt", "input")
             else f"the prompt holds (`{param}` the most of it)")
    return APIError(400, f"{where} {chars:,} characters of text as the model renders it (messages, tools, schemas, "
                    f"suffix); the model `{name}` takes at most {bound.chars:,} ({why}). Shorten the prompt, or "
                    f"send fewer or shorter messages or tools.",
                    param=param, code="context_length_exceeded")


def text_only(name: str, param: str) -> APIError:
    """400: a content part the model's engine cannot read (catalog/context.py `text_only`)."""
    return APIError(400, f"`{param}` is not text, and the model `{name}` reads only text (its engine, llama.cpp, "
                    "runs here without a multimodal projector); send text parts only, or use a vision model",
                    param=param, code="unsupported_content")


def media_url_refused(name: str, param: str, why: str) -> APIError:
    """400: a media part's URL the model's engine would fetch from inside the cluster (gateway/media.py)."""
    return APIError(400, f"`{param}` is a URL the engine of `{name}` would fetch from inside the cluster, and "
                    f"{why}. Send the media inline instead: a data: URL (`data:image/png;base64,...`), or "
                    "`input_audio` with base64 `data`. (An operator may allow URLs for this model with its "
                    "catalog `limits.media_urls`.)", param=param, code="media_url_refused")


def overloaded(name: str, retry_after_s: int = 1) -> APIError:
    """429: the model's queue (`limits.max_queue`) is full."""
    return APIError(429, f"the model `{name}` is at its concurrency limit and its queue is full; retry shortly",
                    type="rate_limit_exceeded", code="model_overloaded", headers={"Retry-After": str(retry_after_s)})


def model_not_allowed(name: str, who: str, patterns: list[str]) -> APIError:
    """403: the key's tenant (or the key itself) may not use this model (issue 15). A 403 rather than
    OpenAI's 404: the name is right, the key is what stops it, and the client's PermissionDeniedError and
    the message say so, where a 404 would send its owner looking for a typo."""
    return APIError(403, f"this API key may not use the model `{name}`: {who} allows only {', '.join(patterns)} "
                    "(an operator changes that with `llmgw ctl tenants set` or `llmgw ctl keys set`)",
                    type="permission_error", param="model", code="model_not_allowed")


def adapter_not_allowed(name: str, tenant: str | None) -> APIError:
    """403: the LoRA adapter `name` is limited to tenants (its catalog `tenants`) and the key's is not one
    (issue 40). Its list is not said: another tenant's name is not this key's to read."""
    who = f"tenant `{tenant}`" if tenant is not None else "a key of no tenant"
    return APIError(403, f"this API key may not use the adapter `{name}`: it is limited to other tenants than "
                    f"{who} (an operator changes that in the catalog, the adapter's `tenants`)",
                    type="permission_error", param="model", code="adapter_not_allowed")


def rate_limited(message: str, retry_after_s: float, headers: dict[str, str]) -> APIError:
    """429: a tenant's or key's requests or tokens per minute are used up (issue 15)."""
    return APIError(429, message, type="rate_limit_exceeded", code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s))), **headers})


def quota_spent(message: str, retry_after_s: float, headers: dict[str, str]) -> APIError:
    """429: a tenant's or key's token budget for the day or month is spent, until the period turns. The
    openai client retries a 429 by itself; `x-should-retry: false` tells it not to wait hours for this one."""
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s))), "x-should-retry": "false",
                             **headers})


def queue_timeout(name: str, waited_s: float, retry_after_s: int = 5) -> APIError:
    """503: waited `limits.queue_timeout_s` for a slot."""
    return APIError(503, f"the model `{name}` is busy: no slot within {waited_s:g}s", type="service_unavailable",
                    code="model_busy", headers={"Retry-After": str(retry_after_s)})


def circuit_open(name: str, retry_after_s: int) -> APIError:
    return APIError(503, f"every replica of `{name}` failed recently; retry in about {retry_after_s}s",
                    type="service_unavailable", code="engine_unavailable", headers={"Retry-After": str(retry_after_s)})


def engine_error(status: int, why: str) -> APIError:
    """An engine's error answer turned into our envelope: 4xx kept (429 with Retry-After), 401 and 403 as 502
    (the engine refused the gateway, not the client: its key, its configuration), 503 kept (with
    Retry-After), 501 (the engine cannot do this request) as 400 `engine_unsupported`, other 5xx as 502."""
    if status == 503:
        return APIError(503, f"the engine is unavailable: {why}", type="service_unavailable", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    if status in (401, 403):
        return APIError(502, f"the engine refused the gateway's credentials (HTTP {status}); the operator has been "
                        "told", type="upstream_error", code="engine_refused_gateway")
    if status == 429:
        return APIError(429, f"the engine is busy: {why}", type="rate_limit_error", code="engine_busy",
                        headers={"Retry-After": "1"})
    if 400 <= status < 500:
        return APIError(status, why, code="engine_refused")
    if status == 501:
        return APIError(400, f"this model's engine cannot serve this request: {why}", code="engine_unsupported")
    return APIError(502, f"the engine failed (HTTP {status}): {why}", type="upstream_error", code="engine_error")


def content_filter(guard: str, stage: str, detail: str, param: str | None) -> APIError:
    """400: the guard model refused the request or the response (seeds 003, "A judge model on the cluster")."""
    what = "request" if stage == "request" else "response"
    extra = f" ({detail})" if detail else ""
    return APIError(400, f"the {what} was refused by the guard model `{guard}`{extra}", param=param,
                    code="content_filter")


def guard_unavailable(guard: str, why: str, retry_after_s: int = 10) -> APIError:
    """503: the guard model could not judge; the request is not served unjudged."""
    return APIError(503, f"the guard model `{guard}` could not judge the request: {why}", type="service_unavailable",
                    code="guard_unavailable", headers={"Retry-After": str(retry_after_s)})


def internal(where: str = "the gateway") -> APIError:
    return APIError(500, f"internal error in {where}; it has been logged", type="server_error", code="internal_error")


def database_away(exc: BaseException) -> APIError | None:
    """503 for a database error that is the database's absence, not the request's fault: a connection
    refused, or lost in the middle of a transaction (PostgreSQL killed or restarted, issue 38); None for any
    other error. The transaction was not committed, or its COMMIT's answer never came: the client is told
    what it changed may not have been saved, and to retry (a catalog apply is idempotent)."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if not isinstance(exc, DBAPIError) or not (exc.connection_invalidated
                                               or isinstance(exc, (OperationalError, InterfaceError))):
        return None
    return APIError(503, "the database is unavailable (its connection failed or was lost); what this request "
                    "changed may not have been saved: retry in a moment", type="service_unavailable",
                    code="database_unavailable", headers={"Retry-After": "5"})


def http_exception_error(method: str, path: str, status: int, detail: object) -> APIError:
    """A framework HTTP error (unknown route, wrong method, an HTTPException) as an `APIError`, so the
    FastAPI apps (the gateway's, the admin API, the node API) answer in the same envelope as every other error."""
    if status == 404:
        return APIError(404, f"no such route: {method} {path}", code="not_found")
    if status == 405:
        return APIError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
    return APIError(status, str(detail), type="service_unavailable" if status == 503 else "invalid_request_error")


def json_error(err: APIError):
    """`err` as a Starlette JSONResponse (for FastAPI handlers; the hot path sends `err.body()` itself)."""
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=err.status, content={"error": {"message": err.message, "type": err.type,
                        "param": err.param, "code": err.code}}, headers=err.headers)


def validation_error(errors: list[dict]):
    """A request body off its schema (FastAPI's `RequestValidationError.errors()`) as 400 `bad_request`,
    one problem per field (`shard.pid: Input should be less than or equal to 4194304`), in the envelope."""
    from starlette.responses import JSONResponse

    fields = [".".join(str(p) for p in e["loc"][1:]) for e in errors]
    problems = [f"{f}: {str(e['msg']).removeprefix('Value error, ')}" for f, e in zip(fields, errors)]
    return JSONResponse(status_code=400, content={"error": {"message": "; ".join(problems[:20]),
                                                            "type": "invalid_request_error",
                                                            "param": fields[0] if fields else None,
                                                            "code": "bad_request", "problems": problems[:100]}})


async def send_error(send: Send, err: APIError, extra: list[tuple[bytes, bytes]] | None = None,
                     body: bytes | None = None) -> None:
    """`err` as the answer; `extra`: headers to send with it (an accounted request's rate-limit headers);
    `body`: its body in another API's envelope (Anthropic's: gateway/messages.py), else OpenAI's."""
    if body is None:
        body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if extra:
        have = {k for k, _ in headers}
        headers += [(k, v) for k, v in extra if k not in have]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app, where: str) -> None:
    """The one set of error handlers every FastAPI app of llmgw uses (gateway, admin API, node API): an
    `APIError` in its envelope; an unknown route or method, or an HTTPException, in the same envelope;
    a body off its schema as 400 `bad_request` naming each field (`validation_error`), never FastAPI's
    422; the database away (a connection refused or lost mid-transaction) 503 `database_unavailable`
    (`database_away`), logged in one line; anything unexpected logged with its traceback and answered 500
    `internal_error` without one.
    `where` names the listener in that 500's message ("the admin API"). An app adds handlers for its own
    domain errors after this (the admin API's `CatalogError`)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return json_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return json_error(http_exception_error(request.method, request.url.path, exc.status_code, exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        return validation_error(exc.errors())

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return json_error(unexpected(request.method, request.url.path, exc, where))


def unexpected(method: str, path: str, exc: Exception, where: str) -> APIError:
    """The answer to an exception nothing else handled, logged: 503 `database_unavailable` for the database
    away (one line), else 500 `internal_error` (with the traceback in the log, never in the answer)."""
    import logging

    log = logging.getLogger(__name__)
    away = database_away(exc)
    if away is not None:
        log.warning("%s %s: the database is unavailable: %s", method, path,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return away
    log.error("unexpected error on %s %s", method, path, exc_info=exc)
    return internal(where)
