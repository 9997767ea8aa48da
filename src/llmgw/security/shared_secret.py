"""A secret the processes of one fleet derive alike, without another setting to distribute: for tenants' cache
salts (gateway/isolation.py) and batch tokens (security/batch_token.py), each under a label of its own."""

from __future__ import annotations

import hashlib
import hmac
import os
from urllib.parse import unquote, urlsplit


def fleet_secret(explicit: str | None, database_url: str | None, label: bytes) -> bytes | None:
    """A secret every gateway and control worker of a fleet derives alike, for `label`'s use: from
    `LLMGW_CACHE_SALT_SECRET` when set, else from the database URL's password (or `PGPASSWORD`), which the
    fleet's processes share and no client knows. None when there is neither."""
    if explicit:
        return hmac.new(explicit.encode(), label, hashlib.sha256).digest()
    password = None
    if database_url:
        try:
            password = urlsplit(database_url).password
        except ValueError:
            password = None
    password = unquote(password) if password else os.environ.get("PGPASSWORD")
    return hmac.new(password.encode(), label, hashlib.sha256).digest() if password else None
