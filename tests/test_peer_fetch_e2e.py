"""The peer rung of the activation ladder (issue 39), through the real processes: a node that must start a
replica whose weights another node holds fetches them from that node's peer listener over mutual TLS, and the
mirror is asked only for the file's digest (a HEAD), never for its bytes."""

from __future__ import annotations

import hashlib
import os
import re

import httpx
import pytest

from llmgw.weights.naming import cache_name_for
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

SIZE = 6 << 20


def model(replicas: int) -> dict:
    return {"models": [{"name": "m", "scaling": {"min": replicas, "max": replicas},
                        "profiles": [{"engine": "sim", "source": "mirror:w.bin", "gpus_per_node": 1}]}]}


def mirror_requests(cp) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{cp.ports['mirror']}/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r'^llmgw_mirror_requests_total\{kind="(\w+)"\} (\S+)$', text, re.M)}


def node_inventory(cp, node_id: str) -> dict:
    nodes = httpx.get(cp.admin + "/admin/v1/nodes", timeout=10, headers=cp.admin_headers).json()
    return next((n.get("inventory") or {} for n in nodes if n["id"] == node_id), {})


def test_a_node_without_the_weights_fetches_them_from_the_peer_that_holds_them(control_plane):
    cp = control_plane.start(mirror=True)
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    data = os.urandom(SIZE)
    (cp.mirror_dir / "w.bin").write_bytes(data)
    name = cache_name_for("mirror:w.bin")

    cp.agent("node-a", simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a")
    assert cp.apply(model(1)).status_code == 200
    [first] = cp.wait_replicas("m", timeout_s=90)
    assert first["node_id"] == "node-a"
    assert "rung: fetch the weights from the mirror (no node holds them)" in first["reason"], first["reason"]
    assert mirror_requests(cp).get("file") == 1  # node-a took the bytes from the mirror
    # node-a's inventory (sent at once after its fetch) lists the weights and its peer listener, pinned.
    inv = wait_until(lambda: (i := node_inventory(cp, "node-a")) and name in i.get("cached_sources", []) and i,
                     timeout_s=30, what="node-a's inventory lists the weights", why=cp.logs)
    assert re.fullmatch(r"https://127\.0\.0\.1:\d+", inv["peer_url"] or ""), inv

    b = cp.agent("node-b", simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a", "node-b")
    assert cp.apply(model(2)).status_code == 200
    [second] = cp.wait_replicas("m", timeout_s=90, exclude={first["id"]})
    assert second["node_id"] == "node-b"
    assert "rung: fetch the weights from a peer, node-a (node-a holds them but cannot take it)" in second["reason"], \
        second["reason"]

    held = cp.state / "cache" / "node-b" / name
    assert hashlib.sha256(held.read_bytes()).digest() == hashlib.sha256(data).digest()
    seen = mirror_requests(cp)
    assert seen.get("file") == 1, seen  # the mirror served no byte of it to node-b
    assert seen.get("head", 0) >= 1, seen  # only its size and sha256, which node-b verified the peer's bytes by
    assert f"{SIZE} from node-a" in b.log(), b.log()[-3000:]
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
