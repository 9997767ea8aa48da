"""What nodes run is compared on every heartbeat, and an agent that stops its engines says so (issue 9,
item 5). Through the real node API (mutual TLS), real agents and engines, with the default (unscaled)
liveness timings: nothing here waits for a node to be judged silent."""

from __future__ import annotations

import json
import ssl
import time

import httpx
import psycopg
import pytest

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

TP8 = {"models": [{"name": "big", "scaling": {"min": 1, "max": 1}, "profiles": [
    {"engine": "sim", "tp": 8, "nodes": 2, "gpu_memory_gb": 40, "args": ["--tokens-per-second", "0"]}]}]}
ONE = {"models": [{"name": "one", "scaling": {"min": 1, "max": 1},
                   "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]}]}


def test_agents_that_stop_their_engines_on_exit_take_their_replicas_out_at_once(control_plane):
    """Two agents run with --stop-engines-on-exit and are stopped with SIGTERM: the engines of a TP8 replica
    over both and of a single-shard replica are gone, and both replicas end within seconds (they are not
    left `ready` until the nodes are judged silent). The single-shard one is lost, as its node reported."""
    cp = control_plane.start()
    agents = [cp.agent(n, simulate=sim_spec(gpus=4, fabric="ib-a")) for n in ("node-a", "node-b")]
    cp.wait_nodes("node-a", "node-b")
    assert cp.apply({"models": TP8["models"] + ONE["models"]}).status_code == 200
    [big] = cp.wait_replicas("big", timeout_s=90)
    [one] = cp.wait_replicas("one", timeout_s=60)
    stopped = time.monotonic()
    for a in agents:
        assert a.stop() == 0

    def status(rid: str) -> str:
        return next(r for r in cp.replicas() if r["id"] == rid)["status"]
    # A TP8 replica whose rank 0 stops first sees its worker exit too: failed or lost, either way out.
    wait_until(lambda: status(big["id"]) in ("lost", "failed") and status(one["id"]) == "lost", timeout_s=10,
               what="both replicas ended once the agents reported their stops", why=cp.logs)
    assert time.monotonic() - stopped < 15  # LLMGW_NODE_UNREACHABLE_AFTER_S: not judged by silence
    failure = next(r for r in cp.replicas() if r["id"] == one["id"])["failure"]
    assert "stopped shard" in failure and "its agent stopped its engines" in failure, failure
    listed = cp.ctl("replicas").stdout
    assert not any(line.startswith(rid[:8]) and " ready " in line for rid in (big["id"], one["id"])
                   for line in listed.splitlines()), listed


def node_client(cp, node_id: str) -> httpx.Client:
    env = cp.node_env(node_id)
    ctx = ssl.create_default_context(cafile=cp.env["LLMGW_CA_CERT"])
    ctx.load_cert_chain(env["LLMGW_NODE_CERT"], env["LLMGW_NODE_KEY"])
    return httpx.Client(base_url=cp.env["LLMGW_NODE_API_URL"], timeout=10, verify=ctx)


def test_a_heartbeat_that_no_longer_lists_a_shard_fails_its_replica(control_plane, database_url):
    """The node's heartbeats are compared with what it runs, not only its registration: a heartbeat that
    lists the shard keeps the replica; the next one without it fails the replica, which leaves routing."""
    cp = control_plane.start()
    agent = cp.agent("n1")
    assert cp.apply(ONE).status_code == 200
    [rep] = cp.wait_replicas("one", timeout_s=60)
    spec = json.loads((cp.state / "shards" / "n1" / f"{rep['id']}-r0.json").read_text())
    agent.kill()  # from here the test speaks for n1, with n1's certificate and boot
    with psycopg.connect(database_url) as conn:
        [(boot,)] = conn.execute("SELECT boot_id FROM nodes WHERE id = 'n1'").fetchall()
    shard = {"shard_id": spec["shard_id"], "replica_id": rep["id"], "model": "one", "profile": "default",
             "state": "ready", "pid": spec["pid"], "endpoint": spec["endpoint"]}
    with node_client(cp, "n1") as c:
        r = c.post("/node/v1/heartbeat", json={"node_id": "n1", "boot_id": boot, "shards": [shard]})
        assert r.status_code == 200 and r.json()["ok"]
        assert next(x for x in cp.replicas() if x["id"] == rep["id"])["status"] == "ready"
        r = c.post("/node/v1/heartbeat", json={"node_id": "n1", "boot_id": boot, "shards": []})
        assert r.status_code == 200
    old = next(x for x in cp.replicas() if x["id"] == rep["id"])
    assert old["status"] == "failed" and "node n1 no longer runs shard" in old["failure"]
