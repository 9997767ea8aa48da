"""The admin API as `llmgw ctl` talks to it: every expected failure (nothing listening, a timeout, an error
answer, something that is not llmgw on the port) is one line on stderr and exit status 1, never a
traceback."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, NoReturn
from urllib.parse import quote

import httpx
import typer

from llmgw.config import Settings
from llmgw.security.admin_token import client_token


def seg(value: str) -> str:
    """`value` as one path segment of an admin URL: every '/', '?', '#' and '%' encoded, and a segment of only
    dots too, so an argument such as `../keys/ID/revoke?` names a thing that does not exist instead of
    reaching another endpoint (URL normalisation removes dot segments before the request is sent)."""
    try:
        out = quote(value, safe="")
    except UnicodeEncodeError:
        not_utf8(value)
    return out.replace(".", "%2E") if set(value) <= {"."} else out


def not_utf8(value: str) -> NoReturn:
    """An argument the terminal sent in another encoding (Python holds its bytes as lone surrogates)."""
    shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    fail(f"the argument {shown!r} is not UTF-8 text (the terminal sent another encoding); type it again in UTF-8")


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one line on stderr and leave with `code`."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


def confirm(question: str) -> bool:
    """Ask `question` (y/N) on stderr, stdout being the command's answer (`ctl keys create` prints the key,
    which a script captures; click's prompt leaves a space on stdout even with err=True). With no answer to
    read (a script with nothing on its input), say how to go on instead of a bare "Aborted.": nothing is
    changed, exit 1."""
    import sys

    typer.echo(f"{question} [y/N]: ", err=True, nl=False)
    line = sys.stdin.readline() if sys.stdin is not None else ""
    if not line:
        typer.echo("", err=True)
        if sys.stdin is not None and sys.stdin.isatty():
            raise typer.Exit(1)  # Ctrl-D at a terminal: the person said no
        fail(f"{question} needs an answer, and none came on the input; nothing was changed. "
             "Add --yes to go ahead without asking")
    return line.strip().lower() in ("y", "yes")


LLMGW_LISTENERS = {"llmgw-gateway": "llmgw's gateway (the OpenAI API)", "llmgw-node-api": "llmgw's node API",
                   "llmgw-mirror": "llmgw's weight mirror"}


def reached(r: httpx.Response) -> str | None:
    """What answered instead of the admin API, when its `server` header says so (http/serving.py names every
    llmgw listener; a proxy in front may replace the header, so an unknown or missing one proves nothing)."""
    server = r.headers.get("server", "")
    if server in LLMGW_LISTENERS:
        return LLMGW_LISTENERS[server]
    if server == "llmgw-admin" or r.status_code < 400:
        return None
    if r.headers.get("content-type", "").startswith("text/html") or (server and not server.startswith("llmgw")):
        return describe(r)
    return None


def describe(r: httpx.Response) -> str:
    """A foreign answer in a few words: the program that says it answered, its content type, an HTML title."""
    import re

    parts = [f"a server that calls itself {r.headers['server']!r}" if r.headers.get("server") else
             "a server that does not say what it is"]
    kind = r.headers.get("content-type", "").split(";")[0].strip()
    if kind:
        parts.append(f"answering {kind}")
    title = re.search(r"<title[^>]*>([^<]{1,80})", r.text[:4096], re.IGNORECASE) if kind == "text/html" else None
    if title:
        parts.append(f"titled {title.group(1).strip()!r}")
    return ", ".join(parts)


class Admin:
    """A short-lived client of the admin API at `Settings().resolved_admin_url`, sending the admin bearer
    token when there is one (security/admin_token.py). `now` is the server's clock (its Date header) at the
    last answer, for AGE columns."""

    def __init__(self, timeout_s: float = 30.0):
        settings = Settings()
        self.url = settings.resolved_admin_url
        self.token = client_token(settings)
        self.headers = {"Authorization": f"Bearer {self.token.value}"} if self.token.value else {}
        self.timeout_s = timeout_s
        self.now = datetime.now(timezone.utc)

    def get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params=params or None)

    def post(self, path: str, body: dict | None = None) -> Any:
        return self._call("POST", path, json=body if body is not None else {})

    def delete(self, path: str, **params: Any) -> Any:
        # A change, so sent as JSON like every other (control/admin_guard.py), though it carries nothing.
        return self._call("DELETE", path, params=params or None, json={})

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            with httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=self.headers) as c:
                r = c.request(method, path, **kw)
        except httpx.ConnectError:
            fail(f"cannot reach the admin API at {self.url}: nothing answers there; is `llmgw server` (or "
                 "`llmgw dev`) running? (LLMGW_ADMIN_URL or LLMGW_ADMIN_PORT say where it is)")
        except httpx.TimeoutException:
            fail(f"the admin API at {self.url} did not answer within {self.timeout_s:g}s")
        except httpx.HTTPError as exc:
            fail(f"talking to the admin API at {self.url} failed: {exc}")
        except httpx.InvalidURL as exc:
            fail(f"the admin API's address {self.url!r} is not a URL ({exc}); set LLMGW_ADMIN_URL to one such as "
                 "http://127.0.0.1:8081")
        except UnicodeEncodeError as exc:
            not_utf8(exc.object if isinstance(exc.object, str) else str(exc.object))
        self._clock(r)
        other = reached(r)
        if other is not None and (r.status_code >= 400 or other.startswith("llmgw's")):
            fail(f"{self.url} is {other}, not llmgw's admin API (HTTP {r.status_code} for {method} {path}); "
                 "set LLMGW_ADMIN_URL (or LLMGW_ADMIN_PORT) to the admin listener, 127.0.0.1:8081 unless "
                 "configured otherwise")
        try:
            body = r.json()
        except ValueError:
            fail(f"{self.url} answered HTTP {r.status_code} with something that is not llmgw's admin API "
                 f"({other or describe(r)}); set LLMGW_ADMIN_URL (or LLMGW_ADMIN_PORT) to the admin listener, "
                 "127.0.0.1:8081 unless configured otherwise")
        if r.status_code >= 400:
            err = body.get("error") if isinstance(body, dict) else None
            msg = err.get("message") if isinstance(err, dict) else None
            if msg is None and isinstance(body, dict):
                msg = body.get("detail")
            if r.status_code == 401 and isinstance(err, dict) and err.get("code") == "invalid_admin_token":
                msg = self._token_refused()
            fail(f"error ({r.status_code}): {msg or r.text[:300]}")
        return body

    def _token_refused(self) -> str:
        """A 401 from the admin guard, told by where this process's token came from: the server cannot say
        which token it expected, and the usual cause is a token from somewhere else (the token file of
        another server's state directory, such as the user's own `llmgw dev`, or a stale variable)."""
        value, source = self.token
        if source == "LLMGW_ADMIN_TOKEN":
            return (f"the admin API at {self.url} refused the token in LLMGW_ADMIN_TOKEN; set LLMGW_ADMIN_TOKEN to "
                    "that server's token (the admin.token file in its state directory), or unset it and set "
                    "LLMGW_STATE_DIR to that directory")
        where = "LLMGW_STATE_DIR" if "LLMGW_STATE_DIR" in os.environ else \
            "the default state directory, as LLMGW_STATE_DIR is unset"
        instead = ("set LLMGW_STATE_DIR to that server's state directory, or LLMGW_ADMIN_TOKEN to its token (the "
                   "admin.token file there)")
        if value is None:
            return (f"the admin API at {self.url} wants its bearer token, and there was none to send: "
                    f"LLMGW_ADMIN_TOKEN is unset and {source} ({where}) cannot be read; {instead}")
        return (f"the admin API at {self.url} refused the token read from {source} ({where}), a token of another "
                f"server or an old one; {instead}")

    def _clock(self, r: httpx.Response) -> None:
        try:
            self.now = parsedate_to_datetime(r.headers["date"])
        except (KeyError, TypeError, ValueError):
            self.now = datetime.now(timezone.utc)
