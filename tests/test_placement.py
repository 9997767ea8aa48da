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

def test_many_placements_per_pass_never_share_a_gpu():
    # Two placements from one snapshot could be handed the same GPUs: each is accounted before the next.
    models = [model("a", tp=4), model("b", tp=4, min=2)]
    nodes = [node("n1", gpus=8), node("n2", gpus=4)]
    plan = plan_pass(snapshot(models, nodes))
    placed = plan.of_kind("place")
    assert [(d.model, d.shards[0].node_id, d.shards[0].gpus) for d in placed] == [
        ("a", "n1", [0, 1, 2, 3]), ("b", "n2", [0, 1, 2, 3]), ("b", "n1", [4, 5, 6, 7])]  # least loaded first
    assert not plan.more
    assert placed[1].reason.startswith("0 of 2 wanted") and placed[2].reason.startswith("1 of 2 wanted")
    # One more does not fit: refused, with the cards this pass gave away named.
    d = only(plan_pass(snapshot([*models, model("c", tp=2)], nodes)), "refuse")
    assert d.model == "c"
    assert "default on n1: needs 2 free GPU(s), 0 of 8 free (held: a on 0,1,2,3; b on 4,5,6,7)" in d.refusals
    assert "default on n2: needs 2 free GPU(s), 0 of 4 free (held: b on 0,1,2,3)" in d.refusals


def test_placements_per_pass_are_capped_and_the_next_pass_follows_at_once():
    plan = plan_pass(snapshot([model("a", min=3), model("b")], [node("n", gpus=8)]), max_placements=2)
    assert [d.kind for d in plan.decisions] == ["place", "place", "wait", "wait"] and plan.more
    assert "2 placements this pass, the most one pass makes, next pass" in plan.decisions[2].reason
    assert plan.decisions[3].model == "b"


def test_room_an_eviction_frees_is_reserved_for_the_model_it_is_for():
    low = model("low", gpus_per_node=2)
    filler = model("filler", gpus_per_node=2, priority=5)
    high = model("high", gpus_per_node=4, priority=10)
    rep = replica("r-low", "low", [("n", [0, 1])])
    plan = plan_pass(snapshot([low, filler, high], [node("n", gpus=4)], [rep]))
    assert only(plan, "evict").replica_id == "r-low"
    # GPUs 2 and 3 are free now, but high needs them once low has drained: filler must not take them.
    assert not plan.of_kind("place")
    [d] = [d for d in plan.for_model("filler")]
    assert d.kind == "refuse" and any("held: high on 0,1,2,3" in r for r in d.refusals), d.refusals


def test_room_draining_replicas_free_is_reserved_too():
    draining = replica("r-old", "old", [("n", [0, 1])], status="draining")
    high = model("high", gpus_per_node=4, priority=10)
    filler = model("filler", gpus_per_node=2)
    plan = plan_pass(snapshot([high, filler], [node("n", gpus=4)], [draining]))
    assert "waiting for draining replica(s) r-old" in plan.for_model("high")[0].reason
    [d] = plan.for_model("filler")
    assert d.kind == "refuse" and any("held: high on 0,1,2,3" in r for r in d.refusals), d.refusals


def test_one_eviction_per_pass_and_placements_beside_it():
    lows = [model(f"low{i}", gpus_per_node=4) for i in range(2)]
    reps = [replica(f"r{i}", f"low{i}", [(f"n{i}", [0, 1, 2, 3])]) for i in range(2)]
    highs = [model(f"high{i}", gpus_per_node=4, priority=10) for i in range(2)]
    small = model("small", gpus_per_node=1, priority=1)
    plan = plan_pass(snapshot([*lows, *highs, small], [node("n0", gpus=4), node("n1", gpus=4), node("n2", gpus=1)], reps))
    assert len(plan.of_kind("evict")) == 1 and plan.more
    waiting = [d for d in plan.for_model("high1") if d.kind == "wait"]
    assert waiting and "one eviction per pass, next pass" in waiting[0].reason
    assert only(plan, "place").model == "small"  # placed in the same pass, on the node nobody needs


def test_higher_priority_is_placed_first():
    plan = plan_pass(snapshot([model("low", gpus_per_node=1), model("high", priority=5, gpus_per_node=1)],
                              [node("n", gpus=1)]))
    assert only(plan, "place").model == "high" and only(plan, "refuse").model == "low"


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


def test_many_placements_match_placing_them_one_at_a_time_from_scratch():
    # The pass reuses each node's judgement until the node changes; placing one replica at a time, each from
    # a fresh view of the snapshot plus the placements before it, must decide exactly the same.
    import random

    from llmgw.placement.place import place_one
    from llmgw.placement.view import FleetView

    for seed in range(60):
        rng = random.Random(seed)
        nodes = [node(f"n{i}", gpus=rng.choice([1, 2, 4, 8]), peers={} if rng.random() < 0.5 else None,
                      cached=[cache_name_for("mirror:w1")] if rng.random() < 0.3 else [])
                 for i in range(rng.randint(1, 6))]
        models = [model(f"m{i}", min=rng.randint(1, 3), tp=rng.choice([1, 2, 4]),
                        source=rng.choice([None, "mirror:w1", "mirror:w2"])) for i in range(rng.randint(1, 5))]
        held = [replica("r0", models[0].name, [(nodes[0].id, [0])])]
        plan = plan_pass(snapshot(models, nodes, held))
        placed = plan.of_kind("place")
        cards = [(s.node_id, g) for d in placed for s in d.shards for g in s.gpus] + [(nodes[0].id, 0)]
        assert len(cards) == len(set(cards)), (seed, plan.explanations())  # no card handed out twice
        before: list = list(held)
        for i, d in enumerate(placed):
            fresh = place_one(next(m for m in models if m.name == d.model),
                              FleetView(nodes, before, models))
            assert (fresh.shards, fresh.refusals) == (d.shards, d.refusals), seed
            before.append(replica(f"p{i}", d.model, [(s.node_id, s.gpus) for s in d.shards], status="starting"))
