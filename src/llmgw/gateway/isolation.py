"""Prefix-cache isolation between tenants (issue 37): what a request's engine is told so that its prompt
can neither hit nor be hit by another tenant's cached prefix.

A shared prefix cache leaks prompts through timing (CVE-2025-46570: a hit on an 8-token prefix is seen
with AUC 0.99). A model's `cache_isolation` (schemas/catalog.py) says what the gateway does about it:

- `tenant` (the default): each tenant's requests share a cache among themselves and with no one else.
  - vLLM, SGLang (`cache_salt` on their OpenAI routes; SGLang's since sglang#10718, isolating only in
    builds with sglang#23300, which carried it to the scheduler),
    the sim engine, and a model's static `endpoints` (most are vLLM or SGLang; one that refuses unknown
    fields wants `shared`): a request of a key that belongs to a tenant is sent `cache_salt`, a secret of
    that tenant (`Salts`). A request of no tenant is sent none: the engines then keep it in an unsalted
    cache no tenant's salted blocks are part of. A salt the client sent itself is folded into its tenant's
    (`Salts.salt`): a tenant can still split its own cache (per end user, as vLLM's field was meant for),
    never reach another's.
  - llama.cpp's llama-server has no salt: a slot keeps its last prompt and reuses its common prefix with
    the next. So once the gateway holds any key of a tenant, every request to a llama.cpp replica of the
    model is sent `cache_prompt: false`, tenants' and the rest alike (a request that may still read the
    cache could read a tenant's prompt there): no prompt cache on that model, which costs each request
    its whole prompt's prefill. A fleet with no tenant is left as it was. For a llama.cpp model serving
    a single tenant, or tenants that trust each other, say `shared`.
- `shared`: the body is left as the client sent it (one cache for everyone on the model's replicas).

The salt is HMAC-SHA256 of the tenant's name (and the client's salt, length-prefixed so that no pair of
names collides) under a secret every gateway derives alike (`salt_secret`), so every gateway and every
restart gives a tenant the same salt (its cache survives them) and no client can compute one. Only chat
and completion requests are salted: embeddings reach no prefix cache worth a salt, and vLLM warns of an
unknown field on each.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
from typing import TYPE_CHECKING, Callable

from llmgw.http import errors
from llmgw.security.shared_secret import fleet_secret

if TYPE_CHECKING:
    from llmgw.gateway.quotas import Account
    from llmgw.schemas.catalog import Model

log = logging.getLogger(__name__)

MAX_CLIENT_SALT = 1024  # characters of a client's own `cache_salt` the gateway folds in
SALTED = "salted"  # an endpoint whose engine takes `cache_salt` (vLLM, SGLang, sim, a static endpoint)
NO_CACHE = "no_cache"  # llama.cpp: no salt; isolation is `cache_prompt: false`
_SALT_LABEL = b"llmgw cache salt v1"


def engine_class(engine: str) -> str:
    """How `engine` (a profile's engine, or `static`) is isolated: `NO_CACHE` for llama.cpp, else `SALTED`."""
    return NO_CACHE if engine == "llamacpp" else SALTED


def salt_secret(explicit: str | None, database_url: str | None) -> bytes:
    """The key tenants' salts are made with: `LLMGW_CACHE_SALT_SECRET` when set; else derived from the
    password in the database URL (or `PGPASSWORD`), which every gateway of a fleet holds alike and no
    client knows; else a random one for this process, with a warning (isolation holds; a tenant's cache
    is then cold after each restart and split between gateways)."""
    secret = fleet_secret(explicit, database_url, _SALT_LABEL)
    if secret is not None:
        return secret
    log.warning("no LLMGW_CACHE_SALT_SECRET and no database password to derive tenants' cache salts from: "
                "using a random one for this process (each gateway and each restart then salts anew)")
    return secrets.token_bytes(32)


def _field(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return len(b).to_bytes(4, "big") + b


class Salts:
    """Tenant -> its `cache_salt` (memoised: one dict lookup per request), and a tenant's salt folded with
    a client's own."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._memo: dict[str, str] = {}

    def _make(self, msg: bytes) -> str:
        mac = hmac.new(self._secret, msg, hashlib.sha256).digest()
        return "llmgw-" + base64.urlsafe_b64encode(mac[:18]).decode()

    def salt(self, tenant: str, client: object = None) -> str:
        """`tenant`'s salt, or, when the client sent a `cache_salt` of its own, the two folded together.
        A client's salt must be a string of 1 to `MAX_CLIENT_SALT` characters (null: none), else 400
        naming `cache_salt` (vLLM refuses an empty or non-string one too)."""
        if client is None:
            s = self._memo.get(tenant)
            if s is None:
                if len(self._memo) > 100_000:  # tenants are bounded (10,000); keep the memo so
                    self._memo.clear()
                s = self._memo[tenant] = self._make(b"t" + _field(tenant))
            return s
        if not isinstance(client, str) or not client or len(client) > MAX_CLIENT_SALT:
            raise errors.bad_request(f"`cache_salt` must be a string of 1 to {MAX_CLIENT_SALT} characters",
                                     param="cache_salt")
        return self._make(b"c" + _field(tenant) + _field(client))


def _with(req: dict, body: bytes, field: str, value: object) -> tuple[dict, bytes]:
    """`req` and its body with `field` set to `value`. The body is a JSON object (parse_request): a field it
    lacks is written before its closing brace, without encoding the rest again; one it has is replaced."""
    if field in req:
        req = {**req, field: value}
        return req, json.dumps(req).encode()
    return {**req, field: value}, body.rstrip()[:-1] + b',"' + field.encode() + b'":' + json.dumps(value).encode() + b"}"


def isolated(req: dict, body: bytes, kind: str, salt: str | None, no_cache: bool) -> tuple[dict, bytes]:
    """The request to send an endpoint of `kind` (`engine_class`): with `salt` as `cache_salt` (SALTED),
    or `cache_prompt: false` when `no_cache` (NO_CACHE); else as it is."""
    if kind == SALTED:
        if salt is not None and req.get("cache_salt") != salt:
            return _with(req, body, "cache_salt", salt)
        return req, body
    if no_cache and req.get("cache_prompt") is not False:
        return _with(req, body, "cache_prompt", False)
    return req, body


class Isolated:
    """One request's isolation: its tenant's salt (None: a request of no tenant) and whether llama.cpp
    endpoints are told `cache_prompt: false` (the gateway holds some tenant's key)."""

    __slots__ = ("salt", "no_cache")

    def __init__(self, salt: str | None, no_cache: bool):
        self.salt = salt
        self.no_cache = no_cache

    def body(self, model: "Model", kind: str, req: dict, data: bytes) -> bytes:
        """The bytes to send an endpoint of `kind` serving `model`, whose request is `req` encoded as `data`."""
        if model.cache_isolation != "tenant":
            return data
        return isolated(req, data, kind, self.salt, self.no_cache)[1]


_UNTENANTED = Isolated(None, True)


class Isolation:
    """The gateway's isolation: `of(account, req)` for each chat or completion request. `tenanted()` says
    whether the key ring holds any tenant's key (gateway/keys.py)."""

    def __init__(self, salts: Salts, tenanted: Callable[[], bool]):
        self.salts = salts
        self.tenanted = tenanted

    def of(self, account: "Account | None", req: dict) -> Isolated | None:
        """None while no tenant has a key (nothing to isolate from); else the request's salt, a 400 for a
        client's `cache_salt` the gateway cannot fold in (`Salts.salt`)."""
        tenant = account.tenant if account is not None else None
        if tenant is None:
            return _UNTENANTED if self.tenanted() else None
        return Isolated(self.salts.salt(tenant, req.get("cache_salt")), True)
