"""Guards for the admin listener: reaching it means holding the control plane.

From seeds 003 ("Stop a browser page ... from running code on the nodes"): it answers only when `Host` is
an IP address or `localhost` (defeats DNS rebinding), refuses requests a browser marks as cross-site
(`Origin`, `Sec-Fetch-Site`), and accepts changes only as `application/json`, which no page can send
across origins without a preflight nobody grants. And it wants the admin bearer token
(security/admin_token.py) whenever it listens beyond loopback; a wrong token is refused everywhere.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw.http.errors import APIError
from llmgw.http.errors import send_error
from llmgw.security.admin_token import bearer_matches

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def host_allowed(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.index("]")]
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def check(method: str, headers: dict[str, str]) -> str | None:
    """The reason to refuse a request, or None to let it through."""
    if not host_allowed(headers.get("host", "")):
        return "the admin API answers only to an IP address or localhost in Host"
    if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return "cross-site requests are refused"
    origin = headers.get("origin")
    if origin and origin != "null":
        o = urlsplit(origin)
        if not host_allowed(o.netloc) or o.netloc != headers.get("host"):
            return "cross-origin requests are refused"
    elif origin == "null":
        return "requests from an opaque origin are refused"
    if method not in SAFE_METHODS:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return "changes must be sent as Content-Type: application/json"
    return None


class AdminGuard:
    """ASGI middleware applying `check` to every HTTP request, then the bearer token: required when
    `require_token`, and checked whenever one is sent."""

    def __init__(self, app: ASGIApp, token: str | None = None, require_token: bool = False):
        if require_token and not token:
            raise ValueError("an admin API that requires a token needs one")
        self.app = app
        self.token = token
        self.require_token = require_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            why = check(scope["method"], headers)
            if why:
                status = 415 if why.startswith("changes must") else 403
                await send_error(send, APIError(status, why, type="forbidden" if status == 403 else "invalid_request_error"))
                return
            sent = headers.get("authorization")
            if (sent is not None or self.require_token) and not (self.token and bearer_matches(sent, self.token)):
                await send_error(send, APIError(
                    401, "the admin API wants its bearer token: `Authorization: Bearer <token>` (`llmgw ctl` sends "
                    "LLMGW_ADMIN_TOKEN, or the token file in the server's state directory)", type="unauthorized",
                    code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}))
                return
            if "\x00" in scope["path"] or b"%00" in scope.get("query_string", b""):
                # No name llmgw stores holds one (Postgres text cannot): a 500 from the driver, before.
                await send_error(send, APIError(400, "the path or query holds a NUL character (%00); no name has one",
                                                code="bad_request"))
                return
        await self.app(scope, receive, send)
