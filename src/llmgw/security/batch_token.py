"""The identity a batch's requests carry to the gateway (issue 41).

`BatchWorkflow`'s activity (control/batch_activities.py) sends each request of a batch through a gateway
over HTTP, so it passes the gateway's own admission; but no key's secret is stored anywhere (only hashes),
so it cannot send the key that made the batch. It sends `Authorization: Bearer llmgw-batch.<batch id>.<key
id>.<mac>` instead: the MAC is HMAC-SHA256 of the batch and key ids under a secret every gateway and control
worker of the fleet holds alike (`LLMGW_CACHE_SALT_SECRET`, else the database URL's password, which no
client knows), and the gateway serves it as that key (its tenant, limits and models) in the `batch` band.
A token names one batch and key: it cannot be turned into another's.
"""

from __future__ import annotations

import hashlib
import hmac

from llmgw.security.shared_secret import fleet_secret

PREFIX = "llmgw-batch."
_LABEL = b"llmgw batch identity v1"


def batch_secret(explicit: str | None, database_url: str | None) -> bytes | None:
    """The fleet's shared secret for batch tokens; None when there is none (batches cannot run)."""
    return fleet_secret(explicit, database_url, _LABEL)


def _mac(secret: bytes, batch_id: str, key_id: str) -> str:
    return hmac.new(secret, f"{batch_id}\n{key_id}".encode(), hashlib.sha256).hexdigest()


def batch_token(secret: bytes, batch_id: str, key_id: str) -> str:
    """The bearer token of `batch_id`'s requests, made by key `key_id` ('' for none)."""
    return f"{PREFIX}{batch_id}.{key_id}.{_mac(secret, batch_id, key_id)}"


def verify(secret: bytes | None, token: str) -> tuple[str, str] | None:
    """(batch id, key id) of a valid batch token; None for anything else."""
    if secret is None or not token.startswith(PREFIX):
        return None
    parts = token[len(PREFIX):].split(".")
    if len(parts) != 3:
        return None
    batch_id, key_id, mac = parts
    return (batch_id, key_id) if hmac.compare_digest(mac, _mac(secret, batch_id, key_id)) else None
