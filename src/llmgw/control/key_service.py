"""API keys for the admin API: create, list, revoke, and set a key's own limits."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import keys_repo, tenants_repo
from llmgw.http.errors import APIError
from llmgw.schemas.tenants import Limits
from llmgw.security.api_keys import KEY_PREFIX, hash_key, new_key


class ApiKeyService:
    """Create, list, revoke keys and set their limits (admin API). Every change reaches every gateway
    through NOTIFY."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def create(self, name: str, tenant: str | None = None, limits: dict | None = None
                     ) -> tuple[str, keys_repo.KeyRow]:
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

    async def list(self) -> list[keys_repo.KeyRow]:
        async with self.engine.connect() as conn:
            return await keys_repo.list_keys(conn)

    async def revoke(self, key_id: str) -> keys_repo.KeyRow | None:
        """Revoke by id; None when there is no such key."""
        async with self.engine.begin() as conn:
            return await keys_repo.revoke_key(conn, key_id)

    async def set_limits(self, key_id: str, change: Limits) -> keys_repo.KeyRow | None:
        """Change a key's own limits (the fields `change` was given); None when there is no such key."""
        async with self.engine.begin() as conn:
            row = await keys_repo.get_key(conn, key_id)
            if row is None:
                return None
            limits = Limits.model_validate(row.limits or {}).updated(change)
            return await keys_repo.set_limits(conn, key_id, limits.stored())
