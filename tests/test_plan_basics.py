"""The reconcile pass as a pure function: min replicas, placements, reasons, expiry."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from llmgw.placement.plan import backoff_delay, plan_pass
from llmgw.schemas.catalog import Model, Profile, Scaling
from llmgw.schemas.inventory import Inventory
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap, ShardPlacement, Snapshot

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def model(name: str, mn: int = 1, mx: int = 1, **kw) -> Model:
    return Model(name=name, scaling=Scaling(min=mn, max=mx), profiles=[Profile(engine="sim", **kw)])


def node(id: str, age_s: float = 1, **inv) -> NodeSnap:
    return NodeSnap(id=id, status="ready", last_heartbeat=NOW - timedelta(seconds=age_s),
                    inventory=Inventory(cpus=4, memory_mb=8192, engines=["sim", "llamacpp"], **inv))


def acting(plan):
    """The decisions that change something (every model also gets a `keep` line for explain)."""
    return [d for d in plan.decisions if d.kind != "keep"]


def snap(models, nodes, replicas=(), states=()) -> Snapshot:
    return Snapshot(now=NOW, unreachable_after_s=15, lost_after_s=300, models=list(models), nodes=list(nodes),
                    replicas=list(replicas), model_states=list(states))


def replica(id: str, m: str, node_id: str, status: str = "ready") -> ReplicaSnap:
    return ReplicaSnap(id=id, model=m, profile="default", status=status, created_at=NOW,
                       shards=[ShardPlacement(node_id=node_id)])


def test_places_every_replica_that_fits_in_one_pass():
    plan = plan_pass(snap([model("a"), model("b", mn=2, mx=2)], [node("n1")]))
    assert [(d.kind, d.model) for d in plan.decisions] == [("place", "a"), ("place", "b"), ("place", "b")]
    assert not plan.more


def test_no_node_is_a_refusal_with_a_reason():
    plan = plan_pass(snap([model("a")], []))
    [d] = plan.decisions
    assert d.kind == "refuse" and "no node has registered" in d.reason


def test_memory_refusal_names_the_node_and_the_numbers():
    m = Model(name="big", scaling=Scaling(min=1, max=1), profiles=[Profile(engine="llamacpp", source="mirror:x.gguf", memory_gb=64)])
    [d] = plan_pass(snap([m], [node("n1")])).decisions
    assert d.kind == "refuse"
    assert any("n1" in r and "needs 64 GB of host memory, 8.0 GB free" in r for r in d.refusals)


def test_satisfied_model_decides_nothing():
    plan = plan_pass(snap([model("a")], [node("n1")], [replica("r1", "a", "n1")]))
    assert acting(plan) == [] and not plan.acts()
    assert plan.decisions[0].kind == "keep" and "1 of 1 wanted" in plan.decisions[0].reason


def test_lost_node_loses_its_replicas_but_unreachable_keeps_them():
    p = plan_pass(snap([model("a")], [node("n1", age_s=400), node("n2")], [replica("r1", "a", "n1")]))
    assert p.node_status["n1"] == "lost"
    assert [d.kind for d in p.decisions] == ["lost", "place"] and p.decisions[1].shards[0].node_id == "n2"
    p = plan_pass(snap([model("a")], [node("n1", age_s=30), node("n2")], [replica("r1", "a", "n1")]))
    assert p.node_status["n1"] == "unreachable" and acting(p) == []


def test_model_removed_from_catalog_is_stopped():
    [d] = plan_pass(snap([], [node("n1")], [replica("r1", "gone", "n1")])).decisions
    assert d.kind == "stop" and "left the catalog" in d.reason


def test_a_model_whose_stored_entry_cannot_be_read_keeps_its_replicas():
    s = snap([], [node("n1")], [replica("r1", "unread", "n1")]).model_copy(update={"unreadable_models": ["unread"]})
    [d] = plan_pass(s).decisions
    assert d.kind == "keep" and d.replica_id == "r1" and "cannot be read" in d.reason
    # A model the catalog does hold is judged as ever, whatever the list says.
    s = snap([model("a")], [node("n1")], [replica("r1", "a", "n1")]).model_copy(update={"unreadable_models": ["a"]})
    assert acting(plan_pass(s)) == []


def test_backoff_holds_a_failing_model():
    st = ModelState(name="a", failures=3, backoff_until=NOW + timedelta(seconds=40))
    [d] = plan_pass(snap([model("a")], [node("n1")], states=[st])).decisions
    assert d.kind == "wait" and "backing off" in d.reason


def test_a_failed_replica_holds_its_model_until_its_failure_is_counted():
    """The node reports the engine's exit (replica failed) before the start workflow settles it and sets the
    backoff: a pass in between must not place the next start, or every failure gets one start for free."""
    failed = ReplicaSnap(id="r1", model="a", profile="default", status="failed", settled=False,
                         shards=[ShardPlacement(node_id="n1")])
    decisions = plan_pass(snap([model("a")], [node("n1")], [failed])).decisions
    assert [d.kind for d in decisions] == ["cleanup", "wait"]
    assert "just failed" in decisions[1].reason
    settled = failed.model_copy(update={"settled": True})
    assert [d.kind for d in plan_pass(snap([model("a")], [node("n1")], [settled])).decisions] == ["place"]


def test_on_demand_runs_while_used_and_stops_when_idle():
    m = Model(name="od", scaling=Scaling(min=0, max=1, idle_timeout=60), profiles=[Profile(engine="sim")])
    asked = ModelState(name="od", demand_at=NOW - timedelta(seconds=5))
    assert plan_pass(snap([m], [node("n1")], states=[asked])).decisions[0].kind == "place"
    idle = ModelState(name="od", last_used_at=NOW - timedelta(seconds=61))
    [d] = acting(plan_pass(snap([m], [node("n1")], [replica("r1", "od", "n1")], [idle])))
    assert d.kind == "stop" and "idle" in d.reason
    busy = ModelState(name="od", last_used_at=NOW - timedelta(seconds=61), in_flight=2)
    assert acting(plan_pass(snap([m], [node("n1")], [replica("r1", "od", "n1")], [busy]))) == []
    assert d.to_zero  # (decide records it: `idle_stopped_at`)
    # Stopped for idleness, then a larger idle_timeout: it stays stopped until a request asks.
    bigger = m.model_copy(update={"scaling": Scaling(min=0, max=1, idle_timeout=600)})
    stopped = ModelState(name="od", last_used_at=NOW - timedelta(seconds=61), idle_stopped_at=NOW - timedelta(seconds=1))
    [d] = plan_pass(snap([bigger], [node("n1")], states=[stopped])).decisions
    assert d.kind == "keep" and "for want of requests" in d.reason
    asked = stopped.model_copy(update={"demand_at": NOW})
    assert plan_pass(snap([bigger], [node("n1")], states=[asked])).decisions[0].kind == "place"
    # A replica lost while in use (no stop for idleness since) is brought back within the idle_timeout.
    lost_in_use = ModelState(name="od", last_used_at=NOW - timedelta(seconds=5), idle_stopped_at=NOW - timedelta(hours=1))
    assert plan_pass(snap([m], [node("n1")], states=[lost_in_use])).decisions[0].kind == "place"


def test_backoff_is_exponential_and_jittered():
    assert backoff_delay(1, 0.5).total_seconds() == 5
    assert backoff_delay(3, 0.5).total_seconds() == 20
    assert backoff_delay(3, 0.0).total_seconds() == 10 and backoff_delay(3, 0.999).total_seconds() < 30
    assert backoff_delay(50, 0.5).total_seconds() == 600
