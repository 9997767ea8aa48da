"""What nodes run is compared on every heartbeat, and an agent that stops its engines says so (issue 9,
item 5). Through the real node API (mutual TLS), real agents and engines, with the default (unscaled)
liveness timings: nothing here waits for a node to be judged silent."""

from __future__ import annotations

import json
import ssl
import time

import httpx
import psutil
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
    assert "left: its agent stopped its engines" in failure, failure
    # An agent stopped on purpose is no restart: `one` (lost because its node left) counts no RESTARTS.
    [view] = [m for m in httpx.get(cp.admin + "/admin/v1/models", headers=cp.admin_headers).json() if m["name"] == "one"]
    assert view["replaced"] == 0, view
    listed = cp.ctl("replicas").stdout
    assert not any(line.startswith(rid[:8]) and " ready " in line for rid in (big["id"], one["id"])
                   for line in listed.splitlines()), listed


def test_an_agent_that_leaves_makes_its_node_unreachable_at_once_and_its_replicas_lost_by_its_exit(control_plane):
    """The rank-1 node of a TP8 replica has its agent stopped (SIGTERM, --stop-engines-on-exit). It says
    goodbye before it stops its engines: the replica ends `lost` for that node's exit (not `failed` by
    rank 0, which loses its partner), the node is Unreachable within seconds (its pollers alone would look
    fresh for a minute), the replacement goes to the two other nodes and never to the one that left, and
    the node is ready again once its agent registers again."""
    cp = control_plane.start()
    for n in ("node-a", "node-b", "node-c"):
        cp.agent(n, simulate=sim_spec(gpus=4, fabric="ib-a"))
    cp.wait_nodes("node-a", "node-b", "node-c")
    assert cp.apply(TP8).status_code == 200
    [big] = cp.wait_replicas("big", timeout_s=90)
    rank0 = next(s["node_id"] for s in big["shards"] if s["rank"] == 0)
    leaving = next(s["node_id"] for s in big["shards"] if s["rank"] == 1)
    pid0 = cp.shard_pid(rank0, f"{big['id']}-r0")
    stopped = time.monotonic()
    assert next(p for p in cp.procs if p.name == f"agent-{leaving}").stop() == 0

    def node(node_id: str) -> dict:
        return next(n for n in httpx.get(cp.admin + "/admin/v1/nodes", timeout=10, headers=cp.admin_headers).json() if n["id"] == node_id)
    ended = wait_until(lambda: next((r for r in cp.replicas() if r["id"] == big["id"]
                                     and r["status"] in ("lost", "failed")), None), timeout_s=10,
                       what="the TP8 replica ended", why=cp.logs)
    assert ended["status"] == "lost" and f"node {leaving} left" in ended["failure"], ended
    wait_until(lambda: node(leaving)["status"] == "unreachable", timeout_s=5, what=f"{leaving} unreachable")
    assert time.monotonic() - stopped < 10  # LLMGW_NODE_UNREACHABLE_AFTER_S is 15: not judged by silence
    assert "its agent left" in cp.ctl("nodes").stdout
    [new] = cp.wait_replicas("big", exclude={big["id"]}, timeout_s=60)
    assert {s["node_id"] for s in new["shards"]} == {"node-a", "node-b", "node-c"} - {leaving}
    wait_until(lambda: not psutil.pid_exists(pid0) or psutil.Process(pid0).status() == psutil.STATUS_ZOMBIE,
               timeout_s=15, what="the old rank 0 stopped")

    cp.agent(leaving, name=f"agent-{leaving}-again", simulate=sim_spec(gpus=4, fabric="ib-a"))
    wait_until(lambda: node(leaving)["status"] == "ready", timeout_s=30, what=f"{leaving} ready again once registered")
    assert "its agent left" not in cp.ctl("nodes").stdout


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


def test_a_shard_still_running_after_its_replica_ended_is_stopped_at_the_next_heartbeat(control_plane, database_url):
    """A stop that never reached the node (its worker cut off from Temporal while its heartbeats still
    arrive, or `stop_shard` failing there) is settled anyway, and the GPUs count as free: the engine must not
    run on beside whatever is placed next. The node's next heartbeat lists the shard; the answer names it,
    and the agent fences the replica and stops the engine."""
    cp = control_plane.start()
    agent = cp.agent("n1")
    assert cp.apply(ONE).status_code == 200
    [rep] = cp.wait_replicas("one", timeout_s=60)
    pid = cp.shard_pid("n1", f"{rep['id']}-r0")
    # The end state such a stop leaves: the replica stopped and settled (every shard "asked to stop", so its
    # GPUs count as free and no cleanup pass will ask again), its engine running on the node.
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE replicas SET status = 'stopped', settled_at = now() WHERE id = %s", (rep["id"],))
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               timeout_s=15, what="the engine of the ended replica stopped", why=cp.logs)
    assert f"still runs shards {rep['id']}-r0 of ended replicas" in cp.logs()
    assert f"control plane asks to stop shard {rep['id']}-r0, whose replica has ended" in agent.log()
    assert (cp.state / "shards" / "n1" / "fences" / rep["id"]).exists()  # no later launch of it either
    assert agent.alive()
