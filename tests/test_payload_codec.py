"""Payload encryption (security/payload_codec.py) through the data converter every llmgw process builds
(temporal.py `data_converter`), and its key file through `llmgw ctl cert payload-key` as an operator runs it."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from temporalio.api.common.v1 import Payload

from llmgw.config import Settings
from llmgw.schemas.mirror import ExploreInput
from llmgw.security.payload_codec import ENCODING, EncryptionCodec, PayloadKeyError, key_id, load_keys
from llmgw.temporal import data_converter

SIGNED = "https://bucket.example/w.gguf?X-Amz-Signature=SECRET-SIG"


def key_file(tmp_path, *keys: bytes, name: str = "payload.key"):
    path = tmp_path / name
    path.write_text("# comment\n" + "".join(base64.b64encode(k).decode() + "  # trailing\n" for k in keys))
    return path


def explore() -> ExploreInput:
    return ExploreInput(name="w", version="1", sources=[SIGNED])


async def test_payloads_are_encrypted_and_read_back_through_the_settings_converter(tmp_path):
    conv = data_converter(Settings(payload_key=key_file(tmp_path, os.urandom(32))))
    [p] = await conv.encode([explore()])
    assert p.metadata["encoding"] == ENCODING
    assert b"SECRET-SIG" not in p.SerializeToString() and b"bucket.example" not in p.SerializeToString()
    [back] = await conv.decode([p], [ExploreInput])
    assert back == explore()
    [q] = await conv.encode([explore()])
    assert q.data != p.data  # a fresh nonce each time


async def test_plain_payloads_from_before_the_key_are_read_as_they_are(tmp_path):
    plain = data_converter(Settings())
    [p] = await plain.encode([explore()])
    assert p.metadata["encoding"] != ENCODING and b"SECRET-SIG" in p.data
    keyed = data_converter(Settings(payload_key=key_file(tmp_path, os.urandom(32))))
    assert await keyed.decode([p], [ExploreInput]) == [explore()]


async def test_rotation_a_second_key_decrypts_and_a_missing_one_is_named(tmp_path):
    old, new = os.urandom(32), os.urandom(32)
    [by_new] = await EncryptionCodec([new]).encode([Payload(data=b"x")])
    assert (await EncryptionCodec([old, new]).decode([by_new]))[0].data == b"x"  # new as the second line
    with pytest.raises(PayloadKeyError, match=key_id(new)):
        await EncryptionCodec([old]).decode([by_new])


async def test_an_altered_or_truncated_payload_is_refused(tmp_path):
    key = os.urandom(32)
    codec = EncryptionCodec([key])
    [p] = await codec.encode([Payload(data=b"secret")])
    altered = Payload(metadata=dict(p.metadata), data=p.data[:-1] + bytes([p.data[-1] ^ 1]))
    with pytest.raises(PayloadKeyError, match="failed authentication"):
        await codec.decode([altered])
    with pytest.raises(PayloadKeyError, match="too short"):
        await codec.decode([Payload(metadata=dict(p.metadata), data=b"abc")])


async def test_encrypt_false_decrypts_without_encrypting(tmp_path):
    key = os.urandom(32)
    rolling = data_converter(Settings(payload_key=key_file(tmp_path, key), payload_encrypt=False))
    [p] = await rolling.encode([explore()])
    assert p.metadata["encoding"] != ENCODING
    [enc] = await data_converter(Settings(payload_key=key_file(tmp_path, key, name="k2"))).encode([explore()])
    assert await rolling.decode([enc], [ExploreInput]) == [explore()]


@pytest.mark.parametrize("text, says", [
    ("", "holds no key"),
    ("# only a comment\n", "holds no key"),
    ("not base64!!\n", "line 1: not base64"),
    (base64.b64encode(b"short").decode(), "a key of 5 bytes"),
    ("\n".join(base64.b64encode(os.urandom(32)).decode() for _ in range(17)), "at most 16"),
    ("é" * 10, "cannot read"),
])
def test_a_key_file_that_cannot_be_used_stops_the_process_naming_the_setting(tmp_path, text, says):
    path = tmp_path / "payload.key"
    path.write_bytes(text.encode())
    with pytest.raises(SystemExit, match="LLMGW_PAYLOAD_KEY") as exc:
        data_converter(Settings(payload_key=path))
    assert says in str(exc.value)
    with pytest.raises(SystemExit, match="cannot read"):
        data_converter(Settings(payload_key=tmp_path / "missing"))


def test_the_key_beside_the_ca_is_found(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    assert Settings(ca_cert=tmp_path / "ca.crt").resolved_payload_key is None
    key_file(tmp_path, os.urandom(32))
    assert Settings(ca_cert=tmp_path / "ca.crt").resolved_payload_key == tmp_path / "payload.key"


def ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "cert", *args], capture_output=True, text=True,
                          timeout=60)


def test_ctl_makes_a_private_key_file_keeps_it_and_rotates_it(tmp_path):
    made = ctl("payload-key", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    path = tmp_path / "payload.key"
    assert (path.stat().st_mode & 0o777) == 0o600
    [first] = load_keys(path)
    assert key_id(first) in made.stdout
    again = ctl("payload-key", "--dir", str(tmp_path))
    assert again.returncode == 0 and "there already" in again.stdout and load_keys(path) == [first]
    rotated = ctl("payload-key", "--dir", str(tmp_path), "--rotate")
    assert rotated.returncode == 0 and "second line" in rotated.stdout, rotated.stderr
    keys = load_keys(path)
    assert keys[0] == first and len(keys) == 2 and key_id(keys[1]) in rotated.stdout
    path.write_text("garbage\n")
    bad = ctl("payload-key", "--dir", str(tmp_path), "--rotate")
    assert bad.returncode == 2 and "not base64" in bad.stdout + bad.stderr and "Traceback" not in bad.stderr
    assert path.read_text() == "garbage\n"  # left as it was
