"""LoRA adapters from the mirror (issue 40), through the real path: a catalog whose sim base carries two
`mirror:` adapters, one of whose files is corrupted on the mirror's disk after it was mirrored (its recorded
sha256 no longer matches). The real node worker fetches and verifies both with the replica's start; the
real gateway loads the good one from the node's verified copy (the sim's `lora:NAME` marker, and the path
it was given is in the node's cache); the bad one is never loaded (the engine never gets a load call for
it), its client gets 503 `adapter_unverified` saying why, and `ctl explain` shows the operator the cause."""

from __future__ import annotations

import hashlib
import json
import os

import httpx
import pytest

from llmgw.weights.manifest import record_sha256
from tests.helpers import wait_until
from tests.test_tenants import auth, chat, create_key

pytestmark = pytest.mark.integration

CATALOG = {"models": [{
    "name": "base", "scaling": {"min": 1, "max": 1},
    "profiles": [{"engine": "sim", "max_loras": 2, "args": ["--tokens-per-second", "0"]}],
    "adapters": [{"name": "good", "source": "mirror:adapters/good.safetensors"},
                 {"name": "rotten", "source": "mirror:adapters/rotten.safetensors", "version": "1"},
                 {"name": "local", "source": "/srv/adapters/local"}]}]}


def mirror_then_corrupt(directory, name: str, data: bytes) -> None:
    """`name` mirrored with its sha256 recorded, then one byte flipped in place with its size and mtime kept:
    the mirror still declares the recorded sha256 (bit rot, a bad disk, a hand edit)."""
    path = directory / name
    path.write_bytes(data)
    record_sha256(directory, {name: hashlib.sha256(data).hexdigest()})
    st = path.stat()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_mirrored_adapter_is_loaded_from_the_verified_copy_and_a_corrupted_one_never_is(control_plane):
    cp = control_plane
    cp.env["LLMGW_ROUTE_REFRESH_S"] = "0.5"
    cp.start(mirror=True)
    adapters = cp.mirror_dir / "adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    (adapters / "good.safetensors").write_bytes(b"good adapter " * 100)
    mirror_then_corrupt(adapters, "rotten.safetensors", b"rotten adapter " * 100)
    key = create_key(cp, "k")
    r = cp.apply(CATALOG)
    assert r.status_code == 200, r.text
    cp.agent("node-a")
    (replica,) = cp.wait_replicas("base", "ready", 1, timeout_s=60)

    last: list[httpx.Response] = []

    def ask(model: str) -> httpx.Response:
        def once():
            last[:] = [httpx.post(cp.gateway + "/v1/chat/completions", json=chat(model, max_tokens=3),
                                  headers=auth(key), timeout=30)]
            # (a 503 while the route table has no replica yet; an unverified adapter's 503 is the answer)
            loading = last[0].status_code == 503 and last[0].json()["error"]["code"] != "adapter_unverified"
            return None if loading else last[0]
        return wait_until(once, timeout_s=20, what=f"an answer for {model}", why=lambda: last[0].text)

    resp = ask("good")
    assert resp.status_code == 200 and resp.json()["system_fingerprint"] == "lora:good", resp.text
    (spec,) = [json.loads(p.read_text()) for p in (cp.state / "shards" / "node-a").glob("*.json")]
    engine = httpx.get(spec["endpoint"] + "/v1/models", headers={"Authorization": f"Bearer {spec['api_key']}"}).json()
    root = next(m["root"] for m in engine["data"] if m["id"] == "good")
    assert root != "mirror:adapters/good.safetensors" and root.endswith("-good.safetensors"), root
    with open(root, "rb") as f:  # the node's verified copy, in its weight cache
        assert f.read() == b"good adapter " * 100

    resp = ask("rotten")
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "adapter_unverified" and err["param"] == "model", err
    assert "`rotten`" in err["message"] and "failed verification on node node-a" in err["message"], err
    assert "sha256" in err["message"], err
    engine_log = open(spec["log_path"]).read()
    assert "load_lora_adapter called for 'good'" in engine_log, engine_log[-2000:]
    assert "rotten" not in engine_log, engine_log[-2000:]  # the engine was never asked to load it

    # A local path is still passed to the engine untouched (compatibility): the sim takes any path.
    resp = ask("local")
    assert resp.status_code == 200 and resp.json()["system_fingerprint"] == "lora:local", resp.text

    out = cp.ctl("explain", "rotten")
    assert out.returncode == 0, out.stderr
    assert "rotten@1: loaded in no replica" in out.stdout, out.stdout
    assert f"NOT LOADABLE in {replica['id'][:8]} (node node-a)" in out.stdout and "sha256" in out.stdout, out.stdout
