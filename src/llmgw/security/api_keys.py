"""Gateway API keys: their form and stored hash. Created and revoked by the control plane
(`control/key_service.py`), checked by every gateway (`gateway/keys.py`).

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

KEY_PREFIX = "llmgw-"


def new_key() -> str:
    """A fresh API key: `llmgw-` + 43 URL-safe characters, the first a letter or digit (drawn again
    otherwise: `llmgw--x...` read as a typo, and its shown prefix as two separators)."""
    return KEY_PREFIX + random_token()


def random_token(nbytes: int = 32) -> str:
    """`secrets.token_urlsafe(nbytes)` whose first character is a letter or digit, never `-` or `_`."""
    while True:
        token = secrets.token_urlsafe(nbytes)
        if token[0].isalnum():
            return token


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


def api_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The API key of a gateway request: its `Authorization: Bearer` token, or its `x-api-key` header (how
    Anthropic's clients send it). Either twice, or both with different keys, is no token: which one is
    meant cannot be told."""
    found = None
    for name, value in headers:
        if name == b"x-api-key":
            if found is not None:
                return None
            found = value.decode("latin-1").strip()
    bearer = bearer_token(headers)
    if found is None:
        return bearer
    if bearer is not None and bearer != found:
        return None
    return found or None