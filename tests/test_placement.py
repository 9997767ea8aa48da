"""Placement and reconcile-pass rules as pure functions (snapshot in, decisions with reasons out).

Each rule here also has a test through the real path (real agents, Temporal, Postgres) in
test_fleet_*.py; these pin the details the real path is too slow to enumerate.
"""

from __future__ import annotations

from datetime import timedelta

from llmgw.placement.fit import fit_node, pick_gpus
from llmgw.placement.plan import backoff_delay, plan_pass
from llmgw.placement.status import node_status
from llmgw.schemas.payloads import ModelState
from llmgw.weights.naming import cache_name_for
from tests.fleet import NOW, model, node, replica, snapshot


def only(plan, kind):
    found = plan.of_kind(kind)
    assert len(found) == 1, plan.explanations()
    return found[0]


# ---- one node ------------------------------------------------------------------------------------------

def test_gpu_memory_is_checked_per_card():
    m = model("m", gpus_per_node=1, gpu_memory_gb=40)
    plan = plan_pass(snapshot([m], [node("small", gpus=2, gpu_gb=24), node("big", gpus=1, gpu_gb=80)]))
    d = only(plan, "place")
    assert d.shards[0].node_id == "big"
    assert any("small: needs 1 free GPU(s) with 40 GB each; 0 free qualify" in r for r in d.refusals), d.refusals


def test_a_node_without_disk_room_is_refused_unless_it_holds_the_weights():
    src = "mirror:w.bin"
    m = model("m", source=src, disk_gb=50)
    nodes = [node("a", disk_gb=10), node("b", disk_gb=10, cached=[cache_name_for(src)])]
    d = only(plan_pass(snapshot([m], nodes)), "place")
    assert d.shards[0].node_id == "b"
    assert "holds the weights" in d.reason
    assert any(r.startswith("default on a: needs 50 GB of disk for the weights, 10.0 GB free") and "does not hold" in r
               for r in d.refusals), d.refusals
    # Without the weights anywhere, nothing can take it and the refusal says why for each node.
    refused = only(plan_pass(snapshot([m], [node("a", disk_gb=10)])), "refuse")
    assert "needs 50 GB of disk" in refused.refusals[0]


def test_weights_being_fetched_by_a_starting_replica_count_against_disk():
    src1, src2 = "mirror:one.bin", "mirror:two.bin"
    m1, m2 = model("one", source=src1, disk_gb=60), model("two", source=src2, disk_gb=60)
    starting = replica("r1", "one", [("a", [])], status="starting")
    d = only(plan_pass(snapshot([m1, m2], [node("a", disk_gb=100)], [starting])), "refuse")
    assert "promised to weights being fetched" in d.refusals[0], d.refusals


def test_prefer_the_node_that_holds_the_weights_over_a_less_loaded_one():
    src = "mirror:w.bin"
    other = model("other", gpus_per_node=1)
    m = model("m", source=src, gpus_per_node=1)
    nodes = [node("a", gpus=2), node("b", gpus=2, cached=[cache_name_for(src)])]
    busy_b = replica("r-other", "other", [("b", [0])])
    d = only(plan_pass(snapshot([other, m], nodes, [busy_b])), "place")
    assert d.model == "m" and d.shards[0].node_id == "b"


def test_cpu_profile_is_placed_by_host_memory():
    m = model("cpu", memory_gb=8)
    other = model("other", memory_gb=6)
    nodes = [node("small", memory_gb=4), node("used", memory_gb=12)]
    plan = plan_pass(snapshot([m, other], nodes, [replica("r", "other", [("used", [])])]))
    d = only(plan, "refuse")
    assert any("small: needs 8 GB of host memory, 4.0 GB free" in r for r in d.refusals)
    assert any("used: needs 8 GB of host memory, 6.0 GB free" in r for r in d.refusals)


def test_llamacpp_gpus_per_node_reserves_that_many_cards_on_one_node():
    m = model("gguf", engine="llamacpp", source="mirror:x.gguf", gpus_per_node=2)
    d = only(plan_pass(snapshot([m], [node("one", gpus=1), node("two", gpus=2)])), "place")
    assert d.shards[0].node_id == "two" and d.shards[0].gpus == [0, 1]
    assert len(d.shards) == 1


def test_tensor_parallel_group_is_taken_on_nvlink_peers():
    peers = {0: [1], 1: [0], 2: [3], 3: [2]}  # PCIe bridges pairing cards
    m = model("tp2", tp=2)
    held = replica("r", "tp2", [("n", [0])])  # GPU 0 taken: 1 and 2 are free but not peers
    nodes = [node("n", gpus=4, peers=peers)]
    d = plan_pass(snapshot([model("tp2", tp=2, min=2)], nodes, [held])).of_kind("place")[0]
    assert d.shards[0].gpus == [2, 3]
    assert "GPUs on NVLink" in d.reason
    assert m.profiles[0].gpus_per_shard == 2


def test_gpu_choice_without_topology_is_the_lowest_free_indices():
    assert pick_gpus([5, 1, 3, 2], {}, 2) == ([1, 2], None)
    assert pick_gpus([1, 2, 3], {1: {3}, 3: {1}, 2: set()}, 2) == ([1, 3], True)
    assert pick_gpus([0, 2], {0: {1}, 1: {0}, 2: {3}, 3: {2}}, 2) == ([0, 2], False)


def test_a_node_with_a_free_nvlink_group_is_preferred():
    peers = {0: [1], 1: [0], 2: [3], 3: [2]}
    nodes = [node("a", gpus=4, peers=peers), node("b", gpus=4, peers=peers)]
    held = [replica("x", "other", [("a", [0, 3])])]  # a has 1 and 2 free: no pair
    d = only(plan_pass(snapshot([model("other", tp=2), model("m", tp=2)], nodes, held)), "place")
    assert d.shards[0].node_id == "b" and d.shards[0].gpus == [0, 1]


def test_engine_not_on_node_is_a_reason():
    f = fit_node(model("v", engine="vllm", source="org/name").profiles[0], node("a", gpus=1, engines=["sim"]))
    assert not f.ok and f.reason == "engine vllm is not available on this node (it has sim)"


# ---- several nodes: the fabric rule ------------------------------------------------------------------

def test_tp8_over_two_nodes_only_within_one_fabric():
    m = model("big", tp=8, nodes=2, gpu_memory_gb=40)
    nodes = [
        node("a", gpus=4, fabrics={"ib-a": ["mlx5_0"]}),
        node("b", gpus=4, fabrics={"ib-b": ["mlx5_0"]}),
        node("c", gpus=4, fabrics={"ib-a": ["mlx5_0"]}),
        node("d", gpus=8),  # no fabric at all
        node("e", gpus=4, fabrics={"ib-b": []}),  # listed, but no adapter with an ACTIVE port
    ]
    d = only(plan_pass(snapshot([m], nodes)), "place")
    assert [(s.node_id, s.rank, s.gpus) for s in d.shards] == [("a", 0, [0, 1, 2, 3]), ("c", 1, [0, 1, 2, 3])]
    assert "fabric ib-a" in d.reason
    text = "\n".join(d.refusals)
    assert "default on fabric ib-b: 1 node(s) can take a shard (b), 2 needed" in text
    assert "default on d: is on no InfiniBand fabric with an active adapter" in text
    assert "default on e: lists fabric ib-b with no active adapter" in text


def test_multi_node_refused_when_no_fabric_has_enough_nodes():
    m = model("big", tp=8, nodes=2)
    nodes = [node("a", gpus=4, fabrics={"ib-a": ["mlx5_0"]}), node("b", gpus=4, fabrics={"ib-b": ["mlx5_0"]})]
    d = only(plan_pass(snapshot([m], nodes)), "refuse")
    assert "fabric ib-a: 1 node(s)" in "\n".join(d.refusals) and "fabric ib-b: 1 node(s)" in "\n".join(d.refusals)


# ---- the pass ------------------------------------------------------------------------------------------

def test_one_placement_per_pass():
    plan = plan_pass(snapshot([model("a"), model("b")], [node("n")]))
    assert [d.kind for d in plan.decisions] == ["place", "wait"]
    assert plan.more and "one placement per pass" in plan.decisions[1].reason


def test_higher_priority_is_placed_first():
    plan = plan_pass(snapshot([model("low"), model("high", priority=5)], [node("n")]))
    assert only(plan, "place").model == "high"


def test_node_expiry_has_two_stages_far_apart():
    assert node_status(NOW - timedelta(seconds=5), NOW, 15, 300) == "ready"
    assert node_status(NOW - timedelta(seconds=20), NOW, 15, 300) == "unreachable"
    assert node_status(NOW - timedelta(seconds=301), NOW, 15, 300) == "lost"
    m = model("m")
    rep = replica("r1", "m", [("a", [])])
    # Unreachable: the replica is kept (a blip must not tear it down), nothing new goes to the node.
    plan = plan_pass(snapshot([m, model("n2")], [node("a", age_s=20), node("b")], [rep]))
    assert plan.node_status["a"] == "unreachable"
    assert not plan.of_kind("lost") and only(plan, "place").model == "n2"
    assert any("a: node is unreachable" in r for r in only(plan, "place").refusals)
    # Lost: the replica is lost, and a replacement is placed elsewhere in the same pass.
    plan = plan_pass(snapshot([m], [node("a", age_s=400), node("b")], [rep]))
    assert only(plan, "lost").replica_id == "r1"
    assert only(plan, "place").shards[0].node_id == "b"


def test_backoff_holds_the_model_and_says_so():
    st = ModelState(name="m", failures=3, backoff_until=NOW + timedelta(seconds=40))
    d = only(plan_pass(snapshot([model("m")], [node("n")], states=[st])), "wait")
    assert "backing off 40s after 3 failed start(s)" in d.reason
    for n in range(1, 12):
        lo, hi = backoff_delay(n, 0.0), backoff_delay(n, 0.999)
        assert lo <= hi and hi <= timedelta(seconds=600)
    assert backoff_delay(1, 0.5) == timedelta(seconds=5) and backoff_delay(3, 0.5) == timedelta(seconds=20)


def test_scale_down_stops_the_newest_first():
    m = model("m", min=1)
    reps = [replica("old", "m", [("n", [])], age_s=500), replica("new", "m", [("n", [])], age_s=5)]
    d = only(plan_pass(snapshot([m], [node("n")], reps)), "stop")
    assert d.replica_id == "new" and d.drain


def test_on_demand_loads_when_asked_and_stops_when_idle():
    m = model("od", min=0, max=1, idle_timeout=60)
    asked = ModelState(name="od", demand_at=NOW - timedelta(seconds=2))
    assert only(plan_pass(snapshot([m], [node("n")], states=[asked])), "place")
    assert "not asked for" in only(plan_pass(snapshot([m], [node("n")])), "keep").reason
    rep = replica("r", "od", [("n", [])])
    idle = ModelState(name="od", last_used_at=NOW - timedelta(seconds=61))
    d = only(plan_pass(snapshot([m], [node("n")], [rep], states=[idle])), "stop")
    assert "idle for 61s" in d.reason
    busy = ModelState(name="od", last_used_at=NOW - timedelta(seconds=61), in_flight=2)
    assert not plan_pass(snapshot([m], [node("n")], [rep], states=[busy])).of_kind("stop")


def test_off_and_no_scaling_run_nothing():
    off = model("off", min=0, max=0)
    assert "scaling is off" in only(plan_pass(snapshot([off], [node("n")])), "keep").reason


def test_a_replica_whose_model_left_the_catalog_is_stopped():
    d = only(plan_pass(snapshot([], [node("n")], [replica("r", "gone", [("n", [])])])), "stop")
    assert "left the catalog" in d.reason


def test_an_unsettled_failed_replica_is_cleaned_up_and_still_holds_its_gpus():
    m = model("m", gpus_per_node=4)
    other = model("other", gpus_per_node=4)
    failed = replica("f", "m", [("n", [0, 1, 2, 3])], status="failed", settled=False)
    plan = plan_pass(snapshot([m, other], [node("n", gpus=4)], [failed]))
    c = only(plan, "cleanup")
    assert c.replica_id == "f" and c.final_status == "failed" and not c.drain
    assert "just failed" in only(plan, "wait").reason  # m itself waits for its failure to be counted
    assert "0 of 4 free" in only(plan, "refuse").refusals[0]  # not handed out before its shards stopped
    settled = failed.model_copy(update={"settled": True})
    assert only(plan_pass(snapshot([m], [node("n", gpus=4)], [settled])), "place")


def test_every_model_gets_a_line_with_its_refusals():
    m = model("m", gpus_per_node=2)
    ok = model("ok")
    plan = plan_pass(snapshot([m, ok], [node("n", gpus=1)], [replica("r", "ok", [("n", [])])]))
    ex = plan.explanations()
    assert ex["ok"][0].startswith("keep ok: 1 of 1 wanted (min 1)")
    assert ex["m"][0].startswith("cannot place m") and "needs 2 free GPU(s), 1 of 1 free" in ex["m"][1]


# ---- eviction and preemption -------------------------------------------------------------------------

def _fleet_for_preemption():
    low_old = model("low-old", gpus_per_node=2)
    low_new = model("low-new", gpus_per_node=2)
    mid = model("mid", gpus_per_node=2, priority=5)
    reps = [replica("r-old", "low-old", [("n", [0, 1])]), replica("r-new", "low-new", [("n", [2, 3])]),
            replica("r-mid", "mid", [("m", [0, 1])])]
    states = [ModelState(name="low-old", last_used_at=NOW - timedelta(seconds=300)),
              ModelState(name="low-new", last_used_at=NOW - timedelta(seconds=5)),
              ModelState(name="mid", last_used_at=NOW - timedelta(seconds=900))]
    return [low_old, low_new, mid], [node("n", gpus=4), node("m", gpus=2)], reps, states


def test_preemption_drains_the_lowest_priority_least_recently_used_replica():
    models, nodes, reps, states = _fleet_for_preemption()
    high = model("high", min=0, max=1, priority=10, gpus_per_node=2)
    states.append(ModelState(name="high", demand_at=NOW))
    plan = plan_pass(snapshot([high, *models], nodes, reps, states))
    ev = only(plan, "evict")
    assert ev.replica_id == "r-old" and ev.model == "low-old" and ev.for_model == "high" and ev.drain
    assert "evicted for high (priority 10 > 0); last used 300s ago" in ev.reason
    wait = [d for d in plan.for_model("high") if d.kind == "wait"][0]
    assert "evicting 1 lower-priority replica(s)" in wait.reason and "r-old" in wait.reason
    assert not plan.of_kind("place")


def test_preemption_evicts_only_what_the_placement_needs():
    models, nodes, reps, states = _fleet_for_preemption()
    high = model("high", priority=10, gpus_per_node=4)  # only node n has 4 GPUs: both low replicas go
    plan = plan_pass(snapshot([high, *models], nodes, reps, states))
    assert sorted(d.replica_id for d in plan.of_kind("evict")) == ["r-new", "r-old"]  # mid (on m) is spared


def test_no_preemption_of_equal_priority_or_when_it_would_not_help():
    models, nodes, reps, states = _fleet_for_preemption()
    same = model("same", priority=0, gpus_per_node=2)
    assert not plan_pass(snapshot([same, *models], nodes, reps, states)).of_kind("evict")
    huge = model("huge", priority=10, gpus_per_node=8)
    plan = plan_pass(snapshot([huge, *models], nodes, reps, states))
    assert not plan.of_kind("evict") and plan.of_kind("refuse")


def test_a_model_waits_for_replicas_already_draining():
    models, nodes, reps, states = _fleet_for_preemption()
    reps[0] = reps[0].model_copy(update={"status": "draining"})
    high = model("high", priority=10, gpus_per_node=2)
    plan = plan_pass(snapshot([high, *models], nodes, reps, states))
    assert not plan.of_kind("evict")
    assert "waiting for draining replica(s) r-old" in [d for d in plan.for_model("high")][0].reason
