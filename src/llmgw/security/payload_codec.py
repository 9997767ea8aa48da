"""Payloads encrypted before they reach Temporal: what a workflow or activity is given (a mirror's signed
source URLs, a catalog's sources, engine settings) is kept in Temporal's history, which everyone who can
read the namespace sees (its web UI, `temporal workflow show`, a database backup). With a payload key every
llmgw process encrypts the payloads it sends with AES-256-GCM and decrypts those it receives; Temporal
keeps only ciphertext.

The key file (`LLMGW_PAYLOAD_KEY`, or `payload.key` beside the CA; `llmgw ctl cert payload-key` makes one)
holds one or more keys, a line each, base64 of 32 random bytes; `#` starts a comment. The first key
encrypts; every key decrypts, so a key is rotated by adding the new one as the second line on every
process, then moving it first. A payload names its key by id (a hash of the key), so a process that lacks
it says which key to copy. A payload that is not encrypted (histories from before, a process not given the
key yet) is read as it is: encryption is turned on without a flag day, and replay of committed histories
is unchanged. `LLMGW_PAYLOAD_ENCRYPT=false` decrypts without encrypting, for the roll-out (every process
gets the key first, then encryption is turned on).

Headers are not encoded (the SDK's default): the node-activity origin token travels there in the clear,
as it is meant to be checked, and it holds no secret. Search attributes stay plain (Temporal indexes them);
memos hold only redacted text."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
AAD = b"llmgw-payload/v1"
NONCE = 12
TAG = 16
KEY_BYTES = 32
MAX_KEYS = 16


class PayloadKeyError(ValueError):
    """A key file that cannot be used, or a payload that cannot be decrypted with the keys held."""


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"llmgw-payload-key\0" + key).hexdigest()[:16]


def parse_keys(text: str, where: str) -> list[bytes]:
    """The keys of a key file's text, first (encrypting) first. Errors name `where` and the line."""
    keys: list[bytes] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            key = base64.b64decode(line, validate=True)
        except (binascii.Error, ValueError):
            raise PayloadKeyError(f"{where} line {n}: not base64; each line is base64 of {KEY_BYTES} random "
                                  f"bytes (`llmgw ctl cert payload-key` writes one)") from None
        if len(key) != KEY_BYTES:
            raise PayloadKeyError(f"{where} line {n}: a key of {len(key)} bytes; AES-256 keys are {KEY_BYTES}")
        keys.append(key)
    if not keys:
        raise PayloadKeyError(f"{where} holds no key; `llmgw ctl cert payload-key` writes one")
    if len(keys) > MAX_KEYS:
        raise PayloadKeyError(f"{where} holds {len(keys)} keys; keep at most {MAX_KEYS} (the current one and "
                              f"those older payloads may still be read with)")
    return keys


def load_keys(path: Path) -> list[bytes]:
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise PayloadKeyError(f"cannot read the payload key file {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    return parse_keys(text, str(path))


def new_key_line() -> str:
    return base64.b64encode(os.urandom(KEY_BYTES)).decode() + "\n"


def create_key_file(path: Path, rotate: bool = False) -> tuple[Path, str]:
    """Write a key file with one new key (mode 0600), or with `rotate` add a new key as the second line of
    the existing one (every process decrypts with it; move it first to encrypt with it). Returns the path
    and the new key's id. An existing file without `rotate` is kept, and its first key's id returned."""
    rotate = rotate and path.exists()
    if path.exists() and not rotate:
        return path, key_id(load_keys(path)[0])
    line = new_key_line()
    if rotate:
        lines = path.read_text(encoding="ascii").splitlines(keepends=True)
        keys = [i for i, raw in enumerate(lines) if raw.split("#", 1)[0].strip()]
        at = keys[0] + 1 if keys else len(lines)
        text = "".join(lines[:at]) + line + "".join(lines[at:])
        parse_keys(text, str(path))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = ("# llmgw payload keys: the first encrypts, all decrypt (docs/security.md, \"Temporal\")\n" + line)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, path)
    return path, key_id(base64.b64decode(line))


class EncryptionCodec(PayloadCodec):
    def __init__(self, keys: Sequence[bytes], encrypt: bool = True):
        if not keys:
            raise PayloadKeyError("an encryption codec needs at least one key")
        self._keys = {key_id(k): AESGCM(k) for k in keys}
        self._current = key_id(keys[0]) if encrypt else None

    @property
    def current_key_id(self) -> str | None:
        return self._current

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if self._current is None:
            return list(payloads)
        aead = self._keys[self._current]
        out = []
        for p in payloads:
            nonce = os.urandom(NONCE)
            out.append(Payload(metadata={"encoding": ENCODING, KEY_ID: self._current.encode()},
                               data=nonce + aead.encrypt(nonce, p.SerializeToString(), AAD)))
        return out

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decode_one(p) for p in payloads]

    def decode_one(self, p: Payload) -> Payload:
        if p.metadata.get("encoding") != ENCODING:
            return p  # written before encryption was on, or by a process without the key yet
        kid = p.metadata.get(KEY_ID, b"").decode("ascii", "replace")
        aead = self._keys.get(kid)
        if aead is None:
            raise PayloadKeyError(f"a payload encrypted with payload key {kid or '(none named)'}, which this "
                                  f"process does not hold: add that key to its LLMGW_PAYLOAD_KEY file "
                                  f"(every process needs every key still in use)")
        if len(p.data) < NONCE + TAG:
            raise PayloadKeyError(f"an encrypted payload of {len(p.data)} bytes (key {kid}): too short to be one")
        try:
            plain = aead.decrypt(p.data[:NONCE], p.data[NONCE:], AAD)
        except InvalidTag:
            raise PayloadKeyError(f"an encrypted payload (key {kid}) failed authentication: it was altered, "
                                  f"or another key has the same id") from None
        inner = Payload()
        inner.ParseFromString(plain)
        return inner
