"""The fleet simulator through the real path (issue 42): a real control plane (`llmgw server`, `llmgw worker`,
Postgres, Temporal) and one `llmgw sim-fleet` process playing four nodes, each with its own certificate,
registration and task queue. Three models are placed on them, started by the start workflow on the
nodes' queues, served by the simulator's shared engine (no engine process), and answer through the gateway."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

NODES = [f"sim-{i:02d}" for i in range(4)]
CATALOG = {"models": [{"name": f"m{i}", "scaling": {"min": 1, "max": 1},
                       "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}
                      for i in range(3)]}


def listening(endpoint: str) -> bool:
    u = urlparse(endpoint)
    with socket.socket() as s:
        return s.connect_ex((u.hostname, u.port)) == 0


def test_one_process_plays_four_nodes_whose_replicas_serve_through_the_gateway(control_plane):
    cp = control_plane.start()
    sim = cp.spawn("sim-fleet", "sim-fleet", "--nodes", "4", "--node-prefix", "sim-", "--issue-certs",
                   "--stop-engines-on-exit", "--simulate", sim_spec(gpus=1, gpu_memory_gb=80))
    nodes = cp.wait_nodes(*NODES, timeout_s=60)
    wait_until(lambda: "all 4 simulated nodes registered" in sim.log(), timeout_s=10, what="the fleet saying it is up")
    assert sorted(n["id"] for n in nodes if n["status"] == "ready") == NODES
    # Each node proved its identity with its own certificate, issued by the CA for its id.
    assert all((cp.pki / f"node-{n}.crt").exists() for n in NODES)

    assert cp.apply(CATALOG).status_code == 200
    ready = {m: cp.wait_replicas(m, timeout_s=60)[0] for m in ("m0", "m1", "m2")}
    placed = sorted(s["node_id"] for r in ready.values() for s in r["shards"])
    assert len(set(placed)) == 3 and set(placed) <= set(NODES)  # one GPU each: three different nodes

    # (http/gc_tuning.py: the gateway's and the node API's processes run with the collector tuned)
    server_log = next(p for p in cp.procs if p.name == "server").log()
    assert server_log.count("collects its youngest generation every 50000 allocations") == 2, server_log[-3000:]

    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "α β γ δ "

    # Served inside the simulator: every shard's pid is its own, and it spawned no engine process.
    specs = [json.loads(p.read_text()) for p in (cp.state / "shards").glob("sim-*/*.json")]
    assert len(specs) == 3 and {s["pid"] for s in specs} == {sim.proc.pid}
    assert all(s["in_process"] and listening(s["endpoint"]) for s in specs)
    # Each node at its own loopback address, as N machines: its engines there, its node-API connection from there.
    hosts = {urlparse(s["endpoint"]).hostname for s in specs}
    assert len(hosts) == 3 and all(h.startswith("127.1.0.") for h in hosts)
    assert not [c for c in psutil.Process(sim.proc.pid).children(recursive=True) if "sim_server" in " ".join(c.cmdline())]

    # Stopped, each node says it is leaving and reports its stops; the replicas' ports close with it.
    assert sim.stop(grace_s=30) == 0, sim.log()[-3000:]
    assert not any(listening(s["endpoint"]) for s in specs)
    wait_until(lambda: not [x for x in cp.replicas(all=False) if x["status"] == "ready"], timeout_s=30,
               what="no replica Ready once the simulator left")
    assert "told the control plane this node is leaving" in sim.log()
