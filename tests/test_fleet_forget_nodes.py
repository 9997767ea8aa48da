"""Decommissioned machines stop growing every snapshot, through the real path: a node Lost for longer than
`node_forget_after_s` is forgotten by the reconciler, and `llmgw ctl nodes remove NODE` forgets one now,
refusing (unless --force) while a replica still runs on it."""

from __future__ import annotations

import httpx
import pytest

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

UNREACHABLE_S, LOST_S, FORGET_S = 3, 10, 12
MODEL = {"name": "m", "scaling": {"min": 1, "max": 1},
         "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}


def node_ids(cp) -> set[str]:
    return {n["id"] for n in httpx.get(cp.admin + "/admin/v1/nodes", timeout=10, headers=cp.admin_headers).json()}


def test_lost_nodes_are_forgotten_and_ctl_nodes_remove_forgets_one_now(control_plane):
    cp = control_plane
    cp.env.update(LLMGW_NODE_UNREACHABLE_AFTER_S=str(UNREACHABLE_S), LLMGW_NODE_LOST_AFTER_S=str(LOST_S),
                  LLMGW_NODE_FORGET_AFTER_S=str(FORGET_S))
    cp.start()
    for n in ("node-a", "node-b", "node-c"):
        cp.agent(n, simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a", "node-b", "node-c")
    assert cp.apply({"models": [MODEL]}).status_code == 200
    [rep] = cp.wait_replicas("m", timeout_s=60)
    assert rep["node_id"] == "node-a"

    # The admin API: bad bodies and names get clear 4xx, a dry run changes nothing.
    url = cp.admin + "/admin/v1/nodes/node-a/remove"
    r = httpx.post(url, json={"forse": True}, timeout=10, headers=cp.admin_headers)
    assert r.status_code == 400 and "forse" in r.json()["error"]["message"]
    r = httpx.post(url, content=b'{"force": true}', headers={"Content-Type": "text/plain", **cp.admin_headers}, timeout=10)
    assert r.status_code == 415 and "application/json" in r.text
    r = httpx.post(cp.admin + "/admin/v1/nodes/" + "x" * 5000 + "/remove", json={}, timeout=10, headers=cp.admin_headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(url, json={"dry_run": True}, timeout=10, headers=cp.admin_headers)
    assert r.status_code == 200 and not r.json()["removed"] and [x["id"] for x in r.json()["live_replicas"]] == [rep["id"]]
    r = httpx.post(url, json={}, timeout=10, headers=cp.admin_headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "node_in_use"
    assert "node-a" in node_ids(cp)

    # A node with a live replica is not removed without --force, and says why.
    out = cp.ctl("nodes", "remove", "node-a", "--yes")
    assert out.returncode == 1, out
    assert f"live replica {rep['id'][:8]} of m (ready)" in out.stdout
    assert "still holds shards of 1 replica(s)" in out.stderr and "--force" in out.stderr
    assert "node-a" in node_ids(cp)
    out = cp.ctl("nodes", "remove", "no-such-node", "--yes")
    assert out.returncode == 1 and "no node named 'no-such-node'" in out.stderr
    out = cp.ctl("nodes", "remove", "node-x", "--yes")  # a typo: the node meant (nothing removed)
    assert out.returncode == 1 and "no node named 'node-x'; did you mean 'node-" in out.stderr, out.stderr

    # node-c dies and holds nothing: Lost, then forgotten once Lost for longer than the retention.
    cp.kill_node("node-c")
    wait_until(lambda: "node-c" not in node_ids(cp), timeout_s=FORGET_S + 20, what="node-c forgotten")
    assert {"node-a", "node-b"} <= node_ids(cp)
    assert "forgot node node-c" in next(p for p in cp.procs if p.name == "worker").log()

    # node-a's machine is decommissioned: removed now with --force; its replica is rebuilt elsewhere.
    cp.kill_node("node-a")
    out = cp.ctl("nodes", "remove", "node-a", "--force", "--yes")
    assert out.returncode == 0, out
    assert "removed node-a; 1 replica(s) on it are lost and rebuilt elsewhere" in out.stdout
    assert "node-a" not in node_ids(cp)
    [new] = cp.wait_replicas("m", exclude={rep["id"]}, timeout_s=30)
    assert new["node_id"] == "node-b"
    # The replacement's start and the lost replica's stop run side by side: either may land first.
    old = wait_until(lambda: next((r for r in cp.replicas() if r["id"] == rep["id"] and r["status"] == "lost"), None),
                     timeout_s=15, what="the replica on node-a marked lost")
    assert old["status"] == "lost" and "node node-a is lost" in old["ended_reason"]
    assert "node-a" not in cp.ctl("nodes").stdout
