"""Crash faults of a multi-node replica (issue 38, item 7): a TP2 replica over two simulated nodes on one
InfiniBand fabric, a third node on it, a single-node model serving beside it, sim engines and client traffic.
Real server, worker, PostgreSQL and Temporal."""

from __future__ import annotations

import time

import psutil
import psycopg
import pytest

from tests.faults.conftest import LOST_S, FaultFleet, sim_model
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

NODES = ("node-a", "node-b", "node-c")
STEADY = sim_model("steady", priority=10)
BIG = {"name": "big", "scaling": {"min": 1, "max": 1}, "profiles": [
    {"engine": "sim", "tp": 2, "nodes": 2, "args": ["--tokens-per-second", "0"]}]}


@pytest.fixture(scope="module")
def fleet(infra, tmp_path_factory):
    # A database of its own: its third node, left Lost, must not be in the other modules' fleets.
    f = FaultFleet(tmp_path_factory.mktemp("multinode"), infra, database="multinode_faults").start(
        nodes=NODES, gpus=2, fabric="ib-a")
    try:
        assert f.cp.apply({"models": [STEADY, BIG]}).status_code == 200
        f.steady(["steady", "big"], timeout_s=120)
        yield f
    finally:
        f.close()


def settled(fleet: FaultFleet, replica_id: str) -> bool:
    """Its stop is done: the planner no longer counts its GPUs as held."""
    with psycopg.connect(fleet.db_url) as conn:
        return bool(conn.execute("SELECT settled_at IS NOT NULL FROM replicas WHERE id = %s", (replica_id,)).fetchone()[0])


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_agent_of_a_rank_1_shard_killed_the_replica_is_lost_replaced_and_its_engines_stopped(fleet):
    """The agent of the node holding rank 1 of a TP2 replica is SIGKILLed and does not come back (its engine,
    a process of its own, runs on). The node's witnesses both fall silent: it is Unreachable, then Lost after
    `node_lost_after_s`, and the replica with it: lost, not stuck, its GPUs freed once settled. Rank 0's
    engine, on a healthy node, is stopped by the replica's stop (the replica is gone with its node, and
    rank 0's GPU is needed for the rebuild), and the replica is rebuilt on the two nodes left on the fabric. The model
    beside it keeps its engine and serves every request. Rank 1's engine, unsupervised, ends with its group.
    (Its agent returning is `test_observer_faults.py::test_one_node_partitioned_only_its_replicas_move`'s
    case: the engines of its lost replicas are stopped.)"""
    serving = fleet.steady(["steady", "big"])
    big_id = serving["big"][0]
    [big] = [r for r in fleet.replicas("big") if r["id"] == big_id]
    rank0, rank1 = (next(s["node_id"] for s in big["shards"] if s["rank"] == r) for r in (0, 1))
    pid0, pid1 = fleet.cp.shard_pid(rank0, f"{big_id}-r0"), fleet.cp.shard_pid(rank1, f"{big_id}-r1")
    assert serving["steady"][1] != rank1, serving  # placed first, on the first node; rank 1 on another
    with fleet.traffic(["steady"]) as t:
        killed = time.monotonic()
        fleet.proc(f"agent-{rank1}").kill()
        assert not gone(pid1)  # the engine outlives its agent
        wait_until(lambda: next(r for r in fleet.replicas("big") if r["id"] == big_id)["status"] == "lost",
                   timeout_s=LOST_S + 40, what="the replica lost with its rank 1 node", why=fleet.cp.logs)
        assert time.monotonic() - killed >= LOST_S
        wait_until(lambda: gone(pid0), timeout_s=40, what="rank 0's engine stopped on its healthy node",
                   why=fleet.cp.logs)
        [new] = fleet.cp.wait_replicas("big", exclude={big_id}, timeout_s=60)
        assert rank1 not in {s["node_id"] for s in new["shards"]}
        wait_until(lambda: settled(fleet, big_id), timeout_s=40, what="the lost replica settled",
                   why=lambda: fleet.replicas("big"))
    # Rank 1's engine, which no agent supervises now, ends with its group: its rank 0 went (a sim worker, as
    # an NCCL rank whose peer died, exits); were it to hang on, its node's next registration stops it.
    wait_until(lambda: gone(pid1), timeout_s=30, what="the orphaned rank 1 engine ended", why=fleet.cp.logs)
    assert t.failures("steady") == [] and t.count("steady") > 20, t.failures("steady")
    assert fleet.serving()["steady"] == serving["steady"]
    assert [r["id"] for r in fleet.replicas("big") if r["status"] in ("starting", "ready")] == [new["id"]]
