"""Proof of origin for node activities: a node runs only what the control plane's workflows scheduled.

Anyone who reaches the Temporal frontend can put an activity task on `node/<id>`: Temporal's own
authentication (TLS, mTLS, an API key: `temporal.py`) decides who reaches it, not who may command a node.
So every node activity carries a token in its Temporal header `llmgw-origin`, signed (Ed25519) with a key
only the control workers hold (`activity-signing.key`, made beside the CA by `llmgw ctl cert ca`); a node
verifies it with the public half (`activity-signing.pub`, copied to nodes with `ca.crt`).

The token binds what an attacker would change:
- the activity name and the task queue (so the node): a `launch_shard` token is no `stop_shard` one, and
  one for node A is refused on node B;
- the workflow id and run id: run ids are made by the Temporal server, so a token copied out of a history
  (anyone with Temporal access reads histories) is refused in any other workflow run;
- the input, whole: the node parses the token's copy of each argument with its own types and compares it
  with the arguments it was given, so a copied token cannot carry another shard id. Parsing both with the
  node's own types keeps this true across versions: a newer control plane's extra fields are dropped from
  both alike;
- an expiry: the activity must have been first scheduled (a time the Temporal server sets) by then, so a
  token minted now cannot start an activity scheduled later, while an honest activity retried for days
  (a stop waiting for its node to come back) keeps its first schedule time and is still accepted.

Replay never checks: signing happens in the workflow's outbound interceptor (deterministic: Ed25519
signatures are, and the expiry counts from `workflow.now()`), headers are not compared on replay, and the
committed histories, which have no header, replay unchanged (tests/test_replay.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pydantic
import pydantic_core
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

HEADER = "llmgw-origin"
KEY_FILE = "activity-signing.key"
PUB_FILE = "activity-signing.pub"
CONTEXT = b"llmgw node activity origin v1\n"  # signed before the claims: no other signature of this key matches
MAX_TOKEN_BYTES = 1 << 20


class OriginRefused(Exception):
    """A node activity whose origin is not proven; `reason` is one word for logs and metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def create_signing_key(directory: Path) -> tuple[Path, Path]:
    """`activity-signing.key` (mode 0600) and `activity-signing.pub` in `directory`; an existing pair is kept."""
    key_path, pub_path = directory / KEY_FILE, directory / PUB_FILE
    if key_path.exists() and pub_path.exists():
        return key_path, pub_path
    directory.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    pub_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_path, pub_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key (make one with `llmgw ctl cert ca`)")
    return key


def load_public_keys(path: Path) -> list[Ed25519PublicKey]:
    """Every PEM public key in `path`: while keys are rotated, a node trusts the old and the new one."""
    text = path.read_bytes()
    keys = []
    marker = b"-----END PUBLIC KEY-----"
    for block in text.split(marker)[:-1]:
        key = serialization.load_pem_public_key(block.strip() + b"\n" + marker + b"\n")
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{path} holds a key that is not Ed25519")
        keys.append(key)
    if not keys:
        raise ValueError(f"{path} holds no PEM public key")
    return keys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Claims:
    activity: str
    queue: str
    workflow_id: str
    run_id: str
    expires: float  # unix seconds: the activity must have been first scheduled by then
    args: tuple[str, ...]  # each argument as JSON, as the workflow passed it


class Signer:
    """Mints tokens; held by the control worker only."""

    def __init__(self, key: Ed25519PrivateKey, ttl_s: float = 300.0):
        self.key = key
        self.ttl_s = ttl_s

    def token(self, activity: str, queue: str, workflow_id: str, run_id: str, now: datetime,
              args: Sequence[Any], expires: float | None = None) -> str:
        claims = {"a": activity, "q": queue, "w": workflow_id, "r": run_id,
                  "exp": round(now.timestamp() + self.ttl_s, 3) if expires is None else expires,
                  "args": [pydantic_core.to_json(a).decode() for a in args]}
        body = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
        return body + "." + _b64(self.key.sign(CONTEXT + body.encode()))


class Verifier:
    """Checks a token against the activity a node was given; held by every node worker."""

    def __init__(self, keys: list[Ed25519PublicKey]):
        self.keys = keys

    def claims(self, token: str | None) -> Claims:
        if not token:
            raise OriginRefused("unsigned", f"no `{HEADER}` header: not scheduled by an llmgw control worker")
        if len(token) > MAX_TOKEN_BYTES or token.count(".") != 1:
            raise OriginRefused("malformed", f"the `{HEADER}` header is not an llmgw origin token")
        body, sig = token.split(".")
        try:
            signature = _unb64(sig)
        except (binascii.Error, ValueError):
            raise OriginRefused("malformed", f"the `{HEADER}` header is not an llmgw origin token") from None
        for key in self.keys:
            try:
                key.verify(signature, CONTEXT + body.encode())
                break
            except InvalidSignature:
                continue
        else:
            raise OriginRefused("forged", "the origin token is not signed by this fleet's control plane")
        try:
            c = json.loads(_unb64(body))
            return Claims(str(c["a"]), str(c["q"]), str(c["w"]), str(c["r"]), float(c["exp"]),
                          tuple(str(a) for a in c["args"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise OriginRefused("malformed", f"the origin token's claims cannot be read ({exc})") from None

    def check(self, token: str | None, *, activity: str, queue: str, workflow_id: str | None, run_id: str | None,
              scheduled: datetime, args: Sequence[Any]) -> Claims:
        """The claims, when `token` proves this very activity; else `OriginRefused`."""
        c = self.claims(token)
        if c.queue != queue:
            raise OriginRefused("other_node", f"the origin token is for queue {c.queue!r}, not {queue!r}")
        if c.activity != activity:
            raise OriginRefused("other_activity", f"the origin token is for {c.activity!r}, not {activity!r}")
        if (c.workflow_id, c.run_id) != (workflow_id, run_id):
            raise OriginRefused("other_workflow", f"the origin token is for workflow {c.workflow_id} run {c.run_id}, "
                                f"not {workflow_id} run {run_id}: copied from another history")
        if scheduled.timestamp() > c.expires:
            raise OriginRefused("expired", f"the origin token expired {scheduled.timestamp() - c.expires:.0f}s "
                                "before the activity was scheduled")
        if len(c.args) != len(args) or not all(_same(s, a) for s, a in zip(c.args, args)):
            raise OriginRefused("other_input", "the activity's input is not the one its origin token was signed for")
        return c


def _same(signed: str, given: Any) -> bool:
    """Whether the signed JSON of an argument, read with the given argument's own type, equals it."""
    try:
        if isinstance(given, pydantic.BaseModel):
            # As the data converter reads it (temporal.py): unknown fields ignored at every depth.
            return type(given).model_validate_json(signed, extra="ignore") == given
        return json.loads(signed) == pydantic_core.to_jsonable_python(given)
    except (ValueError, pydantic.ValidationError):
        return False
