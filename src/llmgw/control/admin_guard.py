"""Guards for the admin listener: reaching it means holding the control plane.

From seeds 003 ("Stop a browser page ... from running code on the nodes"): it answers only when `Host` is
an IP address or `localhost` (defeats DNS rebinding), refuses requests a browser marks as cross-site
(`Origin`, `Sec-Fetch-Site`), and accepts changes only as `application/json`, which no page can send
across origins without a preflight nobody grants. And it wants the admin bearer token
(security/admin_token.py) on every request, wherever it listens (issue 36: optional on loopback, it let
any local user of a shared machine administer the fleet).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw.http import errors
from llmgw.schemas.api import FLEET_PAGE
from llmgw.http.errors import APIError
from llmgw.http.errors import send_error
from llmgw.security.admin_token import bearer_matches

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
# The fleet page (control/static/fleet.html, at schemas/api.FLEET_PAGE) is the one answer given without the
# token: a static page that holds no data (a browser cannot send a bearer header when it opens a URL); it reads
# the API with the token.


def host_allowed(host: str) -> bool:
    """True for `localhost` or an IP address (`[::1]` bracketed), with or without a port. Anything that is
    not one of these, malformed included (`[`, `[::1`), is False: never an exception (issue 36: `Host: [`
    was a text 500 with a traceback)."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1:] and not _port(host[end + 1:])):
            return False
        name = host[1:end]
    else:
        name, _, port = host.partition(":") if host.count(":") == 1 else (host, "", "")
        if port and not _port(":" + port):
            return False
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _port(rest: str) -> bool:
    """`rest` is `:NNNNN`, a port."""
    return rest[:1] == ":" and rest[1:].isdigit() and len(rest) <= 6


def _origin_netloc(origin: str) -> str | None:
    """The `host[:port]` of an `Origin`, or None when it is no URL (`http://[`: urlsplit raises)."""
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None


def check(method: str, headers: dict[str, str]) -> APIError | None:
    """The refusal of a request (400 for a Host or Origin that is no address at all, 403 for one that is
    not allowed, 415 for a change not sent as JSON), or None to let it through."""
    host = headers.get("host", "")
    if not _well_formed(host):
        return errors.bad_request("the Host header is malformed: send an IP address or localhost, with an "
                                  "optional :port (IPv6 in brackets: [::1]:8081)", param="Host")
    if not host_allowed(host):
        return _forbidden("the admin API answers only to an IP address or localhost in Host")
    if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return _forbidden("cross-site requests are refused")
    origin = headers.get("origin")
    if origin and origin != "null":
        netloc = _origin_netloc(origin)
        if netloc is None:
            return errors.bad_request("the Origin header is malformed: it is no URL", param="Origin")
        if not host_allowed(netloc) or netloc != host:
            return _forbidden("cross-origin requests are refused")
    elif origin == "null":
        return _forbidden("requests from an opaque origin are refused")
    if method not in SAFE_METHODS:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return APIError(415, "changes must be sent as Content-Type: application/json",
                            type="invalid_request_error")
    return None


def _forbidden(why: str) -> APIError:
    return APIError(403, why, type="forbidden")


def _well_formed(host: str) -> bool:
    """A Host that is a name or an address with an optional port; `[` without `]` is not."""
    if host.startswith("["):
        end = host.find("]")
        return end > 0 and (not host[end + 1:] or _port(host[end + 1:]))
    return "[" not in host and "]" not in host


class AdminGuard:
    """ASGI middleware applying `check` to every HTTP request, then the bearer token, always required."""

    def __init__(self, app: ASGIApp, token: str | None):
        if not token:
            raise ValueError("the admin API needs its token")
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refusal = check(scope["method"], headers)
            if refusal is not None:
                await send_error(send, refusal)
                return
            page = scope["path"] == FLEET_PAGE and scope["method"] in ("GET", "HEAD")
            if not page and not bearer_matches(headers.get("authorization"), self.token):
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
