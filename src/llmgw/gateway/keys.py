"""The gateway's key ring: which API keys are valid, and each one's account (tenant and limits), kept in
memory and reloaded on every change notification. A key's form and hash: `security/api_keys.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import keys_repo, tenants_repo
from llmgw.security.api_keys import api_token, hash_key

if TYPE_CHECKING:
    from llmgw.gateway.quotas import Account, Quotas


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
        self.ids: dict[str, tuple[str, str | None]] = {}  # key hash -> (key id, tenant)
        self.by_id: dict[str, "Account | None"] = {}  # key id -> its account (gateway/batches.py)
        self.accounted = False
        self.tenanted = False  # some valid key belongs to a tenant (gateway/isolation.py)
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
        self.ids = {k.key_hash: (k.id, k.tenant) for k in keys}
        self.by_id = {k.id: accounts.get(k.id) for k in keys}
        self.accounted = bool(accounts)
        self.tenanted = any(a.tenant is not None for a in accounts.values() if a is not None)
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
            token = api_token(headers)  # keys not required, but an accounted key is still counted
            return self.entries.get(hash_key(token)) if token is not None else None
        token = api_token(headers)
        if token is None:
            return False
        return self.entries.get(hash_key(token), False)

    def identify(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, str | None] | None | bool:
        """Who sends a request, for what it owns (files, batches): (key id, tenant) of a valid key; None:
        no key, allowed while keys are not required; False: refused."""
        token = api_token(headers)
        if token is None:
            return False if self.required else None
        found = self.ids.get(hash_key(token))
        if found is None:
            return False if self.required else None
        return found
