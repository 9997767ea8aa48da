"""The admin API's bearer token: who may read or change the catalog, keys and fleet.

- The token is `LLMGW_ADMIN_TOKEN` when set (at least 32 characters), else the file
  `<state_dir>/admin.token`, created (mode 0600) at the server's first start.
- The admin API requires it on every request, wherever it listens (issue 36: on loopback it had been
  optional, and any local user of a shared machine could administer the fleet or read engine keys).
- `llmgw ctl` sends it, read the same way, so `llmgw dev` and `llmgw ctl` on one machine need no step.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import NamedTuple

from llmgw.config import Settings
from llmgw.security.api_keys import random_token

MIN_LENGTH = 32
PREFIX = "llmgw-admin-"


def loopback_only(host: str) -> bool:
    """True when a listener on `host` can be reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def ensure_token(settings: Settings) -> str:
    """The token the admin API accepts, creating the token file on first use. Raises SystemExit for a
    `LLMGW_ADMIN_TOKEN` that is too short to be a secret."""
    if settings.admin_token:
        if len(settings.admin_token) < MIN_LENGTH:
            raise SystemExit(f"LLMGW_ADMIN_TOKEN must be at least {MIN_LENGTH} characters of randomness; "
                             f"for example: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        return settings.admin_token
    path = settings.admin_token_path
    existing = read_token_file(settings)
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    token = PREFIX + random_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server on this state directory was quicker
        return read_token_file(settings) or token
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token_file(settings: Settings) -> str | None:
    try:
        return settings.admin_token_path.read_text().strip() or None
    except OSError:
        return None


class ClientToken(NamedTuple):
    """The token `llmgw ctl` sends and where it came from. A refused token is nearly always one from the
    wrong place (another server's state directory, a stale variable), so the refusal names `source`."""

    value: str | None
    source: str  # "LLMGW_ADMIN_TOKEN", or the token file's path (read, or looked for when value is None)


def client_token(settings: Settings) -> ClientToken:
    """What `llmgw ctl` sends: `LLMGW_ADMIN_TOKEN`, else the token file when this user can read it."""
    if settings.admin_token:
        return ClientToken(settings.admin_token, "LLMGW_ADMIN_TOKEN")
    return ClientToken(read_token_file(settings), str(settings.admin_token_path))


def bearer_matches(authorization: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return False
    return hmac.compare_digest(authorization[7:].strip().encode(), token.encode())
