"""Sleeping replicas in the planner (issue 39; placement/sleep.py): when a replica sleeps and wakes, how its
GPUs go to another model at once, the per-node host memory for sleepers, and which engines never sleep.
Pure: snapshots in, decisions out."""

from __future__ import annotations

from datetime import timedelta

from llmgw.placement.fit import node_use
from llmgw.placement.plan import plan_pass
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState
from tests.fleet import NOW, node, replica, snapshot


def sleepy(name: str, sleep_after: float = 60, idle_timeout: float = 600, priority: int = 0, **profile) -> Model:
    profile.setdefault("engine", "sim")
    return Model.model_validate({"name": name, "priority": priority, "profiles": [profile], "scaling": {
        "min": 0, "max": 2, "idle_timeout": idle_timeout, "sleep_after": sleep_after}})


def steady(name: str, priority: int = 0, **profile) -> Model:
    profile.setdefault("engine", "sim")
    return Model.model_validate({"name": name, "priority": priority, "profiles": [profile],
                                 "scaling": {"min": 1, "max": 1}})


def used(name: str, ago_s: float, load: int = 0) -> ModelState:
    return ModelState(name=name, last_used_at=NOW - timedelta(seconds=ago_s), queued=load)


def lines(plan, model: str) -> list[str]:
    return [d.line() for d in plan.for_model(model)]


def test_an_idle_ready_replica_sleeps_after_sleep_after_and_not_before():
    m = sleepy("a", gpus_per_node=1)
    rep = replica("r1", "a", [("n1", [0])])
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [rep], [used("a", 30)]))
    assert plan.of_kind("sleep") == [] and plan.of_kind("stop") == [], lines(plan, "a")
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [rep], [used("a", 90)]))
    [d] = plan.of_kind("sleep")
    assert d.replica_id == "r1"
    assert "idle for 90s (sleep_after 60s, idle_timeout 600s)" in d.reason and "frees its accelerator memory" in d.reason
    assert plan.of_kind("stop") == [] and plan.of_kind("place") == []


def test_a_sleeper_past_idle_timeout_is_stopped_without_a_drain():
    m = sleepy("a", gpus_per_node=1)
    rep = replica("r1", "a", [("n1", [0])], status="sleeping")
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [rep], [used("a", 300)]))
    assert plan.of_kind("stop") == [] and plan.of_kind("wake") == []  # asleep, and kept asleep
    assert any("r1 asleep on n1" in line for line in lines(plan, "a")), lines(plan, "a")
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [rep], [used("a", 700)]))
    [d] = plan.of_kind("stop")
    assert d.replica_id == "r1" and d.drain is False and d.to_zero is True


def test_a_request_wakes_a_sleeper_instead_of_placing_a_replica():
    m = sleepy("a", gpus_per_node=1)
    rep = replica("r1", "a", [("n1", [0])], status="sleeping")
    plan = plan_pass(snapshot([m], [node("n1", gpus=1), node("n2", gpus=1)], [rep], [used("a", 300, load=1)]))
    [d] = plan.of_kind("wake")
    assert d.replica_id == "r1" and "fastest way back" in d.reason
    assert plan.of_kind("place") == []
    # Two wanted (9 waiting, 8 per sim replica), one asleep: the sleeper is woken and one more placed.
    plan = plan_pass(snapshot([m], [node("n1", gpus=1), node("n2", gpus=1)], [rep],
                              [ModelState(name="a", last_used_at=NOW, queued=9)]))
    assert [d.replica_id for d in plan.of_kind("wake")] == ["r1"]
    assert [d.shards[0].node_id for d in plan.of_kind("place")] == ["n2"]


def test_a_sleeper_on_a_silent_node_is_not_woken_and_the_model_is_placed_elsewhere():
    m = sleepy("a", gpus_per_node=1)
    rep = replica("r1", "a", [("n1", [0])], status="sleeping")
    plan = plan_pass(snapshot([m], [node("n1", gpus=1, age_s=60), node("n2", gpus=1)], [rep],
                              [used("a", 1, load=1)]))
    assert plan.of_kind("wake") == []
    assert [d.shards[0].node_id for d in plan.of_kind("place")] == ["n2"]


def test_an_engine_without_sleep_stays_awake_until_idle_timeout():
    for profile in ({"engine": "llamacpp", "source": "mirror:x.gguf"},
                    {"engine": "vllm", "source": "org/m", "device": "cpu", "memory_gb": 4}):
        m = sleepy("a", **profile)
        rep = replica("r1", "a", [("n1", [])])
        plan = plan_pass(snapshot([m], [node("n1")], [rep], [used("a", 90)]))
        assert plan.of_kind("sleep") == [] and plan.of_kind("stop") == [], lines(plan, "a")
        assert any("stays awake" in line and "no sleep mode" in line for line in lines(plan, "a")), lines(plan, "a")


def test_a_model_due_to_sleep_with_nothing_running_is_not_placed_to_sleep():
    m = sleepy("a", gpus_per_node=1)
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [], [used("a", 90)]))
    assert plan.of_kind("place") == []


def test_a_sleepers_gpus_go_to_another_model_at_once_with_the_sleeper_stopped():
    asleep = replica("s1", "a", [("n1", [0])], status="sleeping")
    plan = plan_pass(snapshot([sleepy("a", gpus_per_node=1, priority=5), steady("b", gpus_per_node=1)],
                              [node("n1", gpus=1)], [asleep], [used("a", 100)]))
    [ev] = plan.of_kind("evict")
    assert ev.replica_id == "s1" and ev.drain is False and ev.for_model == "b"
    [d] = plan.of_kind("place")  # the same pass: no wait for a drain
    assert d.model == "b" and d.shards[0].node_id == "n1" and d.shards[0].gpus == [0]
    assert "in the room of sleeping replica(s) s1 of a (stopped)" in d.reason


def test_free_gpus_are_taken_before_a_sleepers():
    asleep = replica("s1", "a", [("n1", [0])], status="sleeping")
    plan = plan_pass(snapshot([sleepy("a", gpus_per_node=1), steady("b", gpus_per_node=1)],
                              [node("n1", gpus=2)], [asleep], [used("a", 100)]))
    assert plan.of_kind("evict") == []
    [d] = plan.of_kind("place")
    assert d.shards[0].gpus == [1]


def test_sleepers_are_evicted_before_a_live_lower_priority_replica():
    low = replica("c1", "c", [("n1", [0])])
    asleep = replica("s1", "a", [("n1", [1])], status="sleeping")
    models = [sleepy("a", gpus_per_node=1, priority=9), steady("b", gpus_per_node=1, priority=5),
              steady("c", gpus_per_node=1, priority=-1)]
    plan = plan_pass(snapshot(models, [node("n1", gpus=2)], [low, asleep], [used("a", 100)]))
    assert [d.replica_id for d in plan.of_kind("evict")] == ["s1"]
    [d] = plan.of_kind("place")
    assert d.model == "b" and d.shards[0].gpus == [1]


def test_the_least_recently_used_sleeper_goes_first():
    s_old = replica("old", "a", [("n1", [0])], status="sleeping")
    s_new = replica("new", "x", [("n1", [1])], status="sleeping")
    models = [sleepy("a", gpus_per_node=1), sleepy("x", gpus_per_node=1), steady("b", gpus_per_node=1)]
    plan = plan_pass(snapshot(models, [node("n1", gpus=2)], [s_old, s_new], [used("a", 500), used("x", 100)]))
    assert [d.replica_id for d in plan.of_kind("evict")] == ["old"]


def test_host_memory_for_sleepers_is_a_per_node_budget():
    nodes = [node("n1", gpus=2, memory_gb=64)]
    older = replica("s1", "x", [("n1", [1])], status="sleeping")
    models = [sleepy("a", gpus_per_node=1, disk_gb=8), sleepy("x", gpus_per_node=1, disk_gb=8)]
    awake = replica("r1", "a", [("n1", [0])])
    states = [used("a", 90), used("x", 300)]

    snap = snapshot(models, nodes, [awake, older], states)
    snap.sleep_host_memory_gb = 10  # room for one sleeper of 8 GB: the least recently used makes way
    plan = plan_pass(snap)
    assert [d.replica_id for d in plan.of_kind("sleep")] == ["r1"]
    [ev] = plan.of_kind("evict")
    assert ev.replica_id == "s1" and ev.drain is False and "host memory for sleepers" in ev.reason

    snap.sleep_host_memory_gb = 16  # room for both
    plan = plan_pass(snap)
    assert [d.replica_id for d in plan.of_kind("sleep")] == ["r1"] and plan.of_kind("evict") == []

    snap.sleep_host_memory_gb = 4  # one alone does not fit: it stays awake
    plan = plan_pass(snap)
    assert plan.of_kind("sleep") == []
    assert any("stays awake" in line and "sleep_host_memory_gb" in line for line in lines(plan, "a")), lines(plan, "a")

    snap.sleep_host_memory_gb = 0  # nothing sleeps
    assert plan_pass(snap).of_kind("sleep") == []

    # A higher-priority sleeper is not evicted for a lower one: it stays awake.
    models[1] = sleepy("x", gpus_per_node=1, disk_gb=8, priority=3)
    snap = snapshot(models, nodes, [awake, older], states)
    snap.sleep_host_memory_gb = 10
    plan = plan_pass(snap)
    assert plan.of_kind("sleep") == [] and plan.of_kind("evict") == []
    assert any("higher-priority sleepers" in line for line in lines(plan, "a")), lines(plan, "a")


def test_the_budget_defaults_to_half_the_nodes_host_memory():
    models = [sleepy("a", gpus_per_node=1, disk_gb=40)]
    awake = replica("r1", "a", [("n1", [0])])
    assert plan_pass(snapshot(models, [node("n1", gpus=1, memory_gb=64)], [awake], [used("a", 90)])).of_kind("sleep") == []
    assert plan_pass(snapshot(models, [node("n1", gpus=1, memory_gb=96)], [awake], [used("a", 90)])).of_kind("sleep")


def test_a_sleeper_holds_its_weights_in_host_memory_and_its_gpus():
    m = sleepy("a", gpus_per_node=1, disk_gb=8, memory_gb=2)
    profiles = {("a", "default"): m.profiles[0]}
    nodes = {"n1": node("n1", gpus=1)}
    awake = node_use([replica("r1", "a", [("n1", [0])])], profiles, nodes)["n1"]
    asleep = node_use([replica("r1", "a", [("n1", [0])], status="sleeping")], profiles, nodes)["n1"]
    assert awake.memory_mb == 2 * 1024 and asleep.memory_mb == 10 * 1024
    assert asleep.gpus == {0: "a"}


def test_an_outdated_sleeper_is_stopped_rather_than_woken():
    m = sleepy("a", gpus_per_node=1)
    rep = replica("r1", "a", [("n1", [0])], status="sleeping").model_copy(update={"profile_hash": "stale"})
    plan = plan_pass(snapshot([m], [node("n1", gpus=1)], [rep], [used("a", 1, load=1)]))
    assert plan.of_kind("wake") == []
    [d] = [d for d in plan.of_kind("stop") if d.replica_id == "r1"]
    assert d.drain is False


def test_a_placement_of_a_model_that_sleeps_is_launched_able_to():
    plan = plan_pass(snapshot([sleepy("a", gpus_per_node=1)], [node("n1", gpus=1)], [], [used("a", 1, load=1)]))
    assert [d.sleep_mode for d in plan.of_kind("place")] == [True]
    cpu = sleepy("a", engine="vllm", source="org/m", device="cpu", memory_gb=4)
    plan = plan_pass(snapshot([cpu], [node("n1")], [], [used("a", 1, load=1)]))
    assert [d.sleep_mode for d in plan.of_kind("place")] == [False]
    plan = plan_pass(snapshot([steady("b", gpus_per_node=1)], [node("n1", gpus=1)], []))
    assert [d.sleep_mode for d in plan.of_kind("place")] == [False]


# ---- the ladder's rungs in the decision line (issue 39, item 2) ----------------------------------------

def test_an_on_demand_start_prefers_a_node_holding_the_weights_and_says_which_rung():
    from llmgw.weights.naming import cache_name_for

    src = "mirror:qwen/"
    m = sleepy("a", source=src, gpus_per_node=1, disk_gb=10)
    busy = replica("other", "b", [("n2", [1])])  # the node holding the weights is the more loaded one
    nodes = [node("n1", gpus=2), node("n2", gpus=2, cached=[cache_name_for(src)])]
    [d] = plan_pass(snapshot([m, steady("b", gpus_per_node=1)], nodes, [busy], [used("a", 1, load=1)])).of_kind("place")
    assert d.shards[0].node_id == "n2"
    assert "n2 holds the weights; rung: start from the weights already in its cache (no fetch)" in d.reason, d.reason

    full = node("n2", gpus=1, cached=[cache_name_for(src)])
    taken = replica("other", "b", [("n2", [0])])
    [d] = plan_pass(snapshot([m, steady("b", gpus_per_node=1)], [node("n1", gpus=1), full], [taken],
                             [used("a", 1, load=1)])).of_kind("place")
    assert d.shards[0].node_id == "n1" and "rung: fetch the weights from the mirror (n2 holds them but cannot take it; serving no peers)" in d.reason
    # The holder serves its cache to peers (node/peer_server.py): the start fetches from it.
    serving = full.model_copy(update={"inventory": full.inventory.model_copy(update={"peer_url": "https://10.0.0.2:9443"})})
    [d] = plan_pass(snapshot([m, steady("b", gpus_per_node=1)], [node("n1", gpus=1), serving], [taken],
                             [used("a", 1, load=1)])).of_kind("place")
    assert "rung: fetch the weights from a peer, n2 (n2 holds them but cannot take it), else the mirror" in d.reason, d.reason

    [d] = plan_pass(snapshot([m], [node("n1", gpus=1)], [], [used("a", 1, load=1)])).of_kind("place")
    assert "rung: fetch the weights from the mirror (no node holds them)" in d.reason
    # No weights to fetch (the sim engine, a model id the engine resolves): no rung to name.
    [d] = plan_pass(snapshot([sleepy("s")], [node("n1")], [], [used("s", 1, load=1)])).of_kind("place")
    assert "rung" not in d.reason


def test_a_wake_says_it_is_the_first_rung():
    rep = replica("r1", "a", [("n1", [0])], status="sleeping")
    [d] = plan_pass(snapshot([sleepy("a", gpus_per_node=1)], [node("n1", gpus=1)], [rep],
                             [used("a", 1, load=1)])).of_kind("wake")
    assert "rung: wake a sleeping replica" in d.reason
