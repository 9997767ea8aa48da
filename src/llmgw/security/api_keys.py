"""Gateway API keys: created and revoked through the admin API, checked by every gateway.

A key is `llmgw-` followed by 43 random URL-safe characters (256 bits). Only its sha256 is stored: a
random key of that length needs no slow password hash, and sha256 lets the gateway check a request with
one hash and one set lookup. The key itself is shown once, when it is created.

When keys are required (`Settings.require_api_key`): unset means "once any key has been created" (revoked
ones count, so revoking the last key does not open the gateway), which keeps `llmgw dev` usable out of the
box; `true` requires a key even before the first is created; `false` never asks for one.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import keys_repo, tenants_repo
from llmgw.gateway.errors import APIError
from llmgw.schemas.tenants import Limits

if TYPE_CHECKING:
    from llmgw.gateway.quotas import Account, Quotas

KEY_PREFIX = "llmgw-"


def new_key() -> str:
    """A fresh API key: `llmgw-` + 43 URL-safe characters."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of a key: sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header in ASGI headers, or None. Two Authorization
    headers are no token: which one is meant cannot be told (the first had won, silently)."""
    found = None
    for name, value in headers:
        if name == b"authorization":
            if found is not None:
                return None
            found = value
    if found is None:
        return None
    scheme, _, token = found.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class KeyRing:
    """The gateway's view of the keys: the hashes of the valid ones, each with its `Account` when it is
    accounted (it belongs to a tenant or has limits: gateway/quotas.py) or None, reloaded on every change
    notification of `api_keys` and `tenants`.

    `require`: the setting (None = required once any key exists, True = always, False = never).
    """

    def __init__(self, engine: AsyncEngine, require: bool | None, quotas: "Quotas | None" = None):
        self.engine = engine
        self.require = require
        self.quotas = quotas
        self.entries: dict[str, "Account | None"] = {}  # key hash -> its account (None: not accounted)
        self.accounted = False
        self.created = 0

    @property
    def required(self) -> bool:
        return self.require if self.require is not None else self.created > 0

    async def refresh(self) -> None:
        async with self.engine.connect() as conn:
            keys, created = await keys_repo.active_keys(conn)
            tenants = await tenants_repo.all_limits(conn) if self.quotas is not None else {}
        accounts = self.quotas.rebuild(tenants, keys) if self.quotas is not None else {}
        self.entries = {k.key_hash: accounts.get(k.id) for k in keys}
        self.accounted = bool(accounts)
        self.created = created

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request with these ASGI headers may use the API."""
        return self.lookup(headers) is not False

    def lookup(self, headers: list[tuple[bytes, bytes]]) -> "Account | None | bool":
        """False: refused (no valid key while keys are required); None: allowed and not accounted; an
        `Account`: allowed, counted and limited. While no key is accounted this costs what it did before
        tenants: nothing when keys are not required, one hash and one dict lookup when they are."""
        if not self.required:
            if not self.accounted:
                return None
            token = bearer_token(headers)  # keys not required, but an accounted key is still counted
            return self.entries.get(hash_key(token)) if token is not None else None
        token = bearer_token(headers)
        if token is None:
            return False
        return self.entries.get(hash_key(token), False)


class ApiKeyService:
    """Create, list, revoke keys and set their limits (admin API). Every change reaches every gateway
    through NOTIFY."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def create(self, name: str, tenant: str | None = None, limits: dict | None = None) -> tuple[str, dict]:
        """Returns (the key, its row). The key is not stored anywhere and cannot be shown again. `tenant`
        must exist (400 `tenant_not_found` naming the field otherwise); `limits` are the key's own."""
        key = new_key()
        async with self.engine.begin() as conn:
            if tenant is not None and not await tenants_repo.tenant_exists(conn, tenant):
                raise APIError(400, f"no tenant named {tenant!r}; `llmgw ctl tenants create {tenant}` first",
                               param="tenant", code="tenant_not_found")
            row = await keys_repo.create_key(conn, uuid.uuid4().hex[:12], name, key[: len(KEY_PREFIX) + 4],
                                             hash_key(key), tenant, limits or {})
        return key, row

    async def list(self) -> list[dict]:
        async with self.engine.connect() as conn:
            return await keys_repo.list_keys(conn)

    async def revoke(self, key_id: str) -> dict | None:
        """Revoke by id; None when there is no such key."""
        async with self.engine.begin() as conn:
            return await keys_repo.revoke_key(conn, key_id)

    async def set_limits(self, key_id: str, change: Limits) -> dict | None:
        """Change a key's own limits (the fields `change` was given); None when there is no such key."""
        async with self.engine.begin() as conn:
            row = await keys_repo.get_key(conn, key_id)
            if row is None:
                return None
            limits = Limits.model_validate(row["limits"] or {}).updated(change)
            return await keys_repo.set_limits(conn, key_id, limits.stored())
