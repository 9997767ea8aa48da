"""Rolling replacement's rules on pure snapshots (placement/rollout.py, plan.py `plan_pass` and
`rollout_step`): each test is a defect found by driving the planner and the rollout the way the reconciler
and the `RolloutWorkflow` do. The real path (a profile change under load, through the gateway, the
reconciler and real engines) is tests/test_rollout.py."""

from __future__ import annotations

from datetime import timedelta

from llmgw.placement.plan import plan_pass, rollout_step
from llmgw.placement.scale import wanted
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap, ShardPlacement, Snapshot
from tests.fleet import NOW, node


def model(profile: dict, mn: int, mx: int, **scaling) -> Model:
    return Model.model_validate({"name": "m", "scaling": {"min": mn, "max": mx, **scaling}, "profiles": [profile]})


SLOW = {"engine": "sim", "args": ["--tokens-per-second", "40"]}
FAST = {"engine": "sim", "args": ["--tokens-per-second", "30"]}


def simulate(old: Model, new: Model, nodes: list[NodeSnap], load: int, start_s: float = 10,
             ticks: int = 40) -> tuple[list[str], int, list[str]]:
    """Place `old`'s replicas, change to `new`, then tick every 5 s: the planner's pass (placed replicas
    are Ready `start_s` later, running what they were placed with), then the rollout's step. Returns the
    log, the most replicas live at once during the rollout, and the ids live at the end."""
    reps: list[dict] = []
    t = NOW
    log: list[str] = []

    def snap(m: Model) -> Snapshot:
        for n in nodes:
            n.last_heartbeat = t
        rs = [ReplicaSnap(id=r["id"], model="m", profile=r["profile"], status=r["status"], created_at=r["created"],
                          profile_hash=r["hash"], shards=r["shards"]) for r in reps if r["status"] in ("starting", "ready")]
        return Snapshot(now=t, models=[m], model_states=[ModelState(name="m", in_flight=load, peak=load, last_used_at=t)],
                        nodes=nodes, replicas=rs)

    def tick(m: Model) -> None:
        for r in reps:
            if r["status"] == "starting" and (t - r["created"]).total_seconds() >= start_s:
                r["status"], r["hash"] = "ready", r["placed_hash"]
        for d in plan_pass(snap(m)).decisions:
            if d.kind == "place":
                reps.append(dict(id=f"r{len(reps) + 1}", profile=d.profile or "default", status="starting", created=t,
                                 hash=None, placed_hash=d.profile_spec.spec_hash(), shards=d.shards))
                log.append(f"place {reps[-1]['id']}")
            elif d.kind == "stop":
                next(r for r in reps if r["id"] == d.replica_id)["status"] = "stopped"
                log.append(f"stop {d.replica_id}")

    for _ in range(4):
        tick(old)
        t += timedelta(seconds=start_s + 1)
    t += timedelta(hours=1)
    most = 0
    for _ in range(ticks):
        tick(new)
        step = rollout_step(snap(new), "m")
        if step.kind == "retire":
            next(r for r in reps if r["id"] == step.replica_id)["status"] = "stopped"
            log.append(f"retire {step.replica_id}")
        most = max(most, sum(r["status"] in ("starting", "ready") for r in reps))
        if step.kind == "done":
            break
        t += timedelta(seconds=5)
    log.append(f"last step: {step.kind}: {step.reason}")
    return log, most, [r["id"] for r in reps if r["status"] in ("starting", "ready")]


def test_a_new_profile_that_fits_no_node_leaves_every_old_replica_serving():
    # It needs 8 GPUs a node; the nodes have 4. Before, each step found no room and retired one more old
    # replica "to place into its room", until none was left and the model was down.
    log, _, live = simulate(model({"engine": "sim", "gpus_per_node": 1}, 2, 2),
                            model({"engine": "sim", "gpus_per_node": 8}, 2, 2), [node("n1", gpus=4), node("n2", gpus=4)],
                            load=2)
    assert live == ["r1", "r2"] and not any(x.startswith("retire") for x in log), log
    assert "does not fit even in the room" in log[-1], log


def test_a_rollout_under_load_surges_by_one_not_up_to_max():
    # min 2, max 5, light load; engines start in 10 s, well inside scale_down_delay: the surge replica was
    # the newest, its hold made the count the new want, and the rollout surged again, to 6 live at once.
    log, most, live = simulate(model(SLOW, 2, 5, target_in_flight=10), model(FAST, 2, 5, target_in_flight=10),
                               [node("n1", memory_gb=256)], load=2)
    assert most == 3 and len(live) == 2 and log[-1].startswith("last step: done"), (most, log)


def test_a_renamed_profile_is_rolled_not_stopped_all_at_once():
    old = Model.model_validate({"name": "m", "scaling": {"min": 2, "max": 2}, "profiles": [{"name": "default", **SLOW}]})
    new = Model.model_validate({"name": "m", "scaling": {"min": 2, "max": 2}, "profiles": [{"name": "fast", **FAST}]})
    log, most, live = simulate(old, new, [node("n1", memory_gb=256)], load=1)
    assert not any(x.startswith("stop") for x in log), log  # before: stop, stop, place, place in one pass
    assert most == 3 and len(live) == 2 and log[-1].startswith("last step: done"), (most, log)


def _two(old: Model, new: Model, second: dict, nodes: list[NodeSnap], st: ModelState) -> Snapshot:
    sh = [ShardPlacement(node_id="n1")]
    reps = [ReplicaSnap(id="old", model="m", profile="default", status="ready", created_at=NOW - timedelta(hours=1),
                        profile_hash=old.profiles[0].spec_hash(), shards=sh),
            ReplicaSnap(model="m", profile="default", profile_hash=new.profiles[0].spec_hash(),
                        **{"shards": sh, **second})]
    return Snapshot(now=NOW, models=[new], model_states=[st], nodes=nodes, replicas=reps)


def test_a_failed_surge_waits_for_its_failure_to_be_counted_before_the_next():
    old, new = model(SLOW, 1, 1), model(FAST, 1, 1)
    st = ModelState(name="m", failures=1, backoff_until=NOW - timedelta(seconds=1), last_used_at=NOW)
    snap = _two(old, new, dict(id="new1", status="failed", settled=False, created_at=NOW - timedelta(seconds=30)),
                [node("n1", memory_gb=64)], st)
    kinds = [d.kind for d in plan_pass(snap).decisions]
    assert "place" not in kinds and "wait" in kinds and "cleanup" in kinds, kinds


def test_a_new_replica_on_a_silent_node_does_not_let_the_old_one_go():
    old, new = model(SLOW, 1, 1), model(FAST, 1, 1)
    snap = _two(old, new, dict(id="new", status="ready", created_at=NOW - timedelta(minutes=5),
                               shards=[ShardPlacement(node_id="n2")]),
                [node("n1", memory_gb=64), node("n2", memory_gb=64, age_s=60)], ModelState(name="m", in_flight=1, peak=1))
    step = rollout_step(snap, "m")
    assert step.kind != "retire", step  # n2 is out of routing: retiring `old` would leave none routed


def test_an_idle_on_demand_model_with_an_outdated_replica_is_stopped_and_its_rollout_ends():
    old = model(SLOW, 0, 2, idle_timeout="600s")
    new = model(FAST, 0, 2, idle_timeout="600s")
    rep = ReplicaSnap(id="old", model="m", profile="default", status="ready", created_at=NOW - timedelta(hours=2),
                      profile_hash=old.profiles[0].spec_hash(), shards=[ShardPlacement(node_id="n1")])
    snap = Snapshot(now=NOW, models=[new], model_states=[ModelState(name="m", last_used_at=NOW - timedelta(hours=1))],
                    nodes=[node("n1", memory_gb=64)], replicas=[rep])
    assert [(d.kind, d.replica_id) for d in plan_pass(snap).decisions] == [("stop", "old")]
    assert rollout_step(snap, "m").kind == "done"  # before: both waited on each other, polling for ever


def test_no_load_reported_still_holds_the_newest_replica_for_its_scale_down_delay():
    # A gateway's load row that stopped counting (a stall, a restart) reads as no load and no peak: the
    # model went straight to min, skipping the hold that protects a fresh scale-up.
    m = model({"engine": "sim"}, 1, 5, target_in_flight=10, scale_down_delay="300s")
    assert wanted(m, ModelState(name="m"), NOW, placed=5, newest_age_s=5).count == 5
    assert wanted(m, ModelState(name="m"), NOW, placed=5, newest_age_s=400).count == 1
    on_demand = model({"engine": "sim"}, 0, 5, idle_timeout="60s")  # idle past idle_timeout: still to zero
    assert wanted(on_demand, ModelState(name="m", last_used_at=NOW - timedelta(hours=1)), NOW, placed=1,
                  newest_age_s=5).count == 0


def test_a_replica_is_outdated_against_the_model_object_it_is_compared_with_not_a_remembered_one():
    """The launched hashes are kept per model object (placement/rollout.py `launched_hashes`, issue 42): a
    changed catalog is a new object, and its replicas of the old profile are outdated at once."""
    from llmgw.placement.rollout import hashes, is_outdated, launched_hashes

    old, new = model(SLOW, 1, 1), model(FAST, 1, 1)
    ran = old.launch_profile(old.profiles[0]).spec_hash()
    r = ReplicaSnap(id="r", model="m", profile="default", status="ready", profile_hash=ran)
    assert not is_outdated(r, old) and launched_hashes(old) is launched_hashes(old)  # kept, not made again
    assert is_outdated(r, new)
    assert hashes(new) == f"default@{new.launch_profile(new.profiles[0]).spec_hash()[:8]}"
    assert not is_outdated(r.model_copy(update={"profile_hash": None}), new)  # not reported yet: not judged
    assert is_outdated(r.model_copy(update={"profile": "gone"}), new)  # a profile the model no longer has
