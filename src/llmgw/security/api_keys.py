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

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import keys_repo

KEY_PREFIX = "llmgw-"


def new_key() -> str:
    """A fresh API key: `llmgw-` + 43 URL-safe characters."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of a key: sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header in ASGI headers, or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class KeyRing:
    """The gateway's view of the keys: hashes of the valid ones, reloaded on every change notification.

    `require`: the setting (None = required once any key exists, True = always, False = never).
    """

    def __init__(self, engine: AsyncEngine, require: bool | None):
        self.engine = engine
        self.require = require
        self.hashes: frozenset[str] = frozenset()
        self.created = 0

    @property
    def required(self) -> bool:
        return self.require if self.require is not None else self.created > 0

    async def refresh(self) -> None:
        async with self.engine.connect() as conn:
            self.hashes, self.created = await keys_repo.key_hashes(conn)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request with these ASGI headers may use the API."""
        if not self.required:
            return True
        token = bearer_token(headers)
        return token is not None and hash_key(token) in self.hashes


class ApiKeyService:
    """Create, list and revoke keys (admin API). Revocation reaches every gateway through NOTIFY."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def create(self, name: str) -> tuple[str, dict]:
        """Returns (the key, its row). The key is not stored anywhere and cannot be shown again."""
        key = new_key()
        async with self.engine.begin() as conn:
            row = await keys_repo.create_key(conn, uuid.uuid4().hex[:12], name, key[: len(KEY_PREFIX) + 4], hash_key(key))
        return key, row

    async def list(self) -> list[dict]:
        async with self.engine.connect() as conn:
            return await keys_repo.list_keys(conn)

    async def revoke(self, key_id: str) -> dict | None:
        """Revoke by id; None when there is no such key."""
        async with self.engine.begin() as conn:
            return await keys_repo.revoke_key(conn, key_id)
