"""Node liveness from two witnesses, the blind observer, the teardown rate limit and the start deadline, as
pure rules (placement/liveness.py, placement/deadline.py). The same rules through real processes:
tests/faults/."""

from __future__ import annotations

import math
from datetime import timedelta

from llmgw.placement.liveness import pollers_seen, witness_status
from llmgw.placement.plan import plan_pass
from llmgw.schemas.payloads import LivenessFacts
from tests.fleet import NOW, model, node, replica, snapshot

UNREACHABLE, LOST, GRACE = 15.0, 300.0, 60.0


def status(hb: float | None, poll: float | None, observer: float | None = 10_000, pollers: float | None = 10_000) -> str:
    return witness_status(hb, poll, observer, pollers, UNREACHABLE, LOST, GRACE).status


def test_a_node_is_silent_only_when_both_witnesses_are():
    assert status(hb=1000, poll=1000) == "lost"
    assert status(hb=1000, poll=1) == "ready"  # node API path broken, worker polling: alive
    assert status(hb=1, poll=1000) == "ready"  # Temporal path broken, heartbeats arriving: alive
    assert status(hb=1000, poll=GRACE + UNREACHABLE + 1) == "unreachable"
    assert status(hb=1000, poll=None) == "lost"  # never seen polling: that witness is silent


def test_an_idle_poll_may_age_by_the_long_poll_interval():
    assert status(hb=1000, poll=GRACE - 1) == "ready"
    assert status(hb=1000, poll=GRACE + UNREACHABLE - 1) == "ready"


def test_a_witness_that_cannot_see_says_nothing():
    # The node API has not been receiving (frozen server, Postgres down): heartbeats say nothing.
    assert status(hb=1000, poll=1000, observer=None) == "ready"
    # It has been receiving again for 20 s: heartbeats count as silent for 20 s, not 1000.
    live = witness_status(1000, 1000, 20, 10_000, UNREACHABLE, LOST, GRACE)
    assert live.status == "unreachable" and live.heartbeat_silent_s == 20
    # Pollers unreadable this pass, or not read for a while (the control worker or Postgres was away).
    assert status(hb=1000, poll=1000, pollers=None) == "ready"
    # Read again for 20 s: they count as silent for 20 s at most.
    assert witness_status(1000, 1000, 10_000, 20, UNREACHABLE, LOST, GRACE).poller_silent_s == 20


def facts(**kw) -> LivenessFacts:
    return LivenessFacts(observer_since=NOW - timedelta(hours=1), pollers_since=NOW - timedelta(hours=1),
                         poller_grace_s=GRACE, **kw)


def polled(n, age_s: float):
    return n.model_copy(update={"polled_at": NOW - timedelta(seconds=age_s)})


def fleet_snapshot(silent: list[str], alive: list[str], replicas=None, **kw):
    nodes = [polled(node(n, gpus=2, age_s=1000), 1000) for n in silent] + [polled(node(n, gpus=2), 1) for n in alive]
    s = snapshot([model("m", min=len(replicas or []) or 1)], nodes, replicas or [])
    return s.model_copy(update={"liveness": facts(**kw)})


def test_one_silent_node_of_two_is_lost_and_its_replica_torn_down():
    plan = plan_pass(fleet_snapshot(["a"], ["b"], [replica("r1", "m", [("a", [0])])]))
    assert plan.node_status == {"a": "lost", "b": "ready"}
    assert [d.replica_id for d in plan.of_kind("lost")] == ["r1"]


def test_a_blind_observer_declares_nothing_lost_and_says_why():
    plan = plan_pass(fleet_snapshot(["a", "b"], [], [replica("r1", "m", [("a", [0])])]))
    assert plan.node_status == {"a": "unreachable", "b": "unreachable"}
    assert not plan.of_kind("lost")
    [held] = [d for d in plan.for_model("m") if d.replica_id == "r1"]
    assert held.kind == "keep"
    assert "2 of 2 nodes are silent together" in held.reason and "nothing is torn down" in held.reason
    assert any("observer is the likelier fault" in line for line in plan.explanations()["m"])


def test_after_a_doubt_every_node_gets_lost_after_s_afresh():
    # Both nodes were cut off; node b came back first. a has been silent far past lost_after_s, but the
    # observer was in doubt 5 s ago: a is not lost for being the last to come back.
    reps = [replica("r1", "m", [("a", [0])])]
    plan = plan_pass(fleet_snapshot(["a"], ["b"], reps, doubted_at=NOW - timedelta(seconds=5)))
    assert plan.node_status["a"] == "unreachable" and not plan.of_kind("lost")
    [held] = [d for d in plan.decisions if d.replica_id == "r1"]
    assert "the observer was in doubt 5s ago" in held.reason
    # lost_after_s after the doubt, it is.
    plan = plan_pass(fleet_snapshot(["a"], ["b"], reps, doubted_at=NOW - timedelta(seconds=LOST)))
    assert [d.replica_id for d in plan.of_kind("lost")] == ["r1"]


def test_the_share_is_configurable_and_strictly_more_than():
    reps = [replica("r1", "m", [("a", [0])])]
    assert plan_pass(fleet_snapshot(["a", "b"], ["c", "d"], reps)).of_kind("lost")  # 2 of 4 = 50 %: not more
    assert not plan_pass(fleet_snapshot(["a", "b", "c"], ["d"], reps)).of_kind("lost")  # 3 of 4
    assert plan_pass(fleet_snapshot(["a", "b", "c"], ["d"], reps, silent_share=0.8)).of_kind("lost")


def test_an_empty_node_long_gone_does_not_make_the_observer_doubt():
    # "old" has been silent far longer than lost_after_s and holds nothing: it says nothing about today.
    old = polled(node("old", gpus=2, age_s=10 * LOST), 10 * LOST)
    s = fleet_snapshot(["a"], ["b"], [replica("r1", "m", [("a", [0])])])
    s = s.model_copy(update={"nodes": [old, *s.nodes]})
    assert [d.replica_id for d in plan_pass(s).of_kind("lost")] == ["r1"]


def test_teardown_for_lost_nodes_is_rate_limited():
    reps = [replica(f"r{i}", "m", [("a", [i])]) for i in range(2)]
    plan = plan_pass(fleet_snapshot(["a"], ["b"], reps, lost_teardown_limit=3, recent_lost=2))
    assert len(plan.of_kind("lost")) == 1
    [kept] = [d for d in plan.decisions if d.kind == "keep" and d.replica_id]
    assert "rate-limited to 3 per 60s" in kept.reason


def test_a_replica_starting_past_its_budget_is_failed():
    m = model("m")
    s = snapshot([m], [node("a", gpus=2)], [replica("r1", "m", [("a", [0])], status="starting", age_s=4000)])
    [d] = plan_pass(s).of_kind("stop")
    assert (d.replica_id, d.final_status, d.drain) == ("r1", "failed", False)
    assert "starting for 4000s, longer than its start budget of 3600s" in d.reason


def test_a_profiles_start_timeout_overrides_the_budget():
    m = model("m", start_timeout="2h")
    s = snapshot([m], [node("a", gpus=2)], [replica("r1", "m", [("a", [0])], status="starting", age_s=4000)])
    assert not plan_pass(s).of_kind("stop")
    m = model("m", start_timeout="10m")
    s = snapshot([m], [node("a", gpus=2)], [replica("r1", "m", [("a", [0])], status="starting", age_s=601)])
    assert plan_pass(s).of_kind("stop")[0].final_status == "failed"


def test_start_timeout_does_not_change_what_an_engine_runs():
    from llmgw.schemas.catalog import Profile

    assert Profile(engine="sim", start_timeout=60).spec_hash() == Profile(engine="sim").spec_hash()


def test_snapshots_recorded_before_liveness_are_judged_by_heartbeats_alone():
    # What the committed workflow histories hold: no `liveness`, no `polled_at`.
    s = snapshot([model("m")], [node("a", gpus=2, age_s=1000), node("b", gpus=2, age_s=1000)],
                 [replica("r1", "m", [("a", [0])])])
    assert s.liveness is None
    plan = plan_pass(s)
    assert plan.node_status == {"a": "lost", "b": "lost"} and plan.of_kind("lost")
    assert math.isfinite(witness_status(1, 1, 1, 1, 1, 2, 0).heartbeat_silent_s or 0)


def test_only_nodes_judged_lost_by_both_witnesses_are_forgotten():
    # decide forgets nodes the planner judges Lost and silent for node_forget_after_s (issue 10 + issue 9).
    from llmgw.control.decide import forgettable

    s = fleet_snapshot(["a"], ["b"])
    assert forgettable(s, LOST) == ["a"] and forgettable(s, 2000) == []
    heard = s.model_copy(update={"nodes": [polled(s.nodes[0], 1), s.nodes[1]]})  # heartbeats silent, pollers not
    assert forgettable(heard, LOST) == []
    blind = fleet_snapshot(["a", "b"], [], [replica("r1", "m", [("a", [0])])])  # the observer is doubted
    assert forgettable(blind, LOST) == []


def test_a_node_whose_agent_left_is_unreachable_at_once_and_nothing_is_placed_there():
    """Its witnesses still look fresh (the pollers' grace alone is a minute), but its agent said goodbye:
    Unreachable, nothing placed on it, and why in words. Lost still takes both witnesses' silence."""
    left = fleet_snapshot([], ["a", "b"])
    left.nodes[0] = left.nodes[0].model_copy(update={"left_at": NOW - timedelta(seconds=3)})
    plan = plan_pass(left)
    assert plan.node_status == {"a": "unreachable", "b": "ready"}
    [placed] = plan.of_kind("place")
    assert {s.node_id for s in placed.shards} == {"b"}
    from llmgw.placement.liveness import fleet_liveness
    assert fleet_liveness(left).nodes["a"].describe().startswith("its agent left 3s ago")
    # Registered again (left_at cleared): ready as before.
    assert plan_pass(fleet_snapshot([], ["a", "b"])).node_status == {"a": "ready", "b": "ready"}
    # Silent as well, for longer than lost_after_s: lost, as any silent node.
    gone = fleet_snapshot(["a"], ["b"])
    gone.nodes[0] = gone.nodes[0].model_copy(update={"left_at": NOW - timedelta(seconds=1000)})
    assert plan_pass(gone).node_status == {"a": "lost", "b": "ready"}


def test_a_witness_heard_within_a_couple_of_heartbeats_reads_fresh():
    from llmgw.placement.liveness import witness_status
    healthy = witness_status(1.4, 0.0, 100.0, 100.0, 15.0, 300.0, 60.0)
    assert healthy.status == "ready" and healthy.describe() == "heartbeats fresh, pollers fresh"
    quiet = witness_status(9.0, 0.0, 100.0, 100.0, 15.0, 300.0, 60.0)
    assert quiet.describe().startswith("heartbeats silent 9s")


def test_pollers_read_as_the_witness_last_saw_them():
    # An idle poll began 48 s before now, read 3 s ago: within the 60 s long poll, so polling (not "48s ago").
    assert pollers_seen(48, 3, 60) == "polling, read 3s ago"
    # Its last poll began 70 s before the read: silent, counted to now.
    assert pollers_seen(250, 3, 60) == "silent 4m, read 3s ago"
    assert pollers_seen(None, None, 60) == "never seen"
    assert pollers_seen(12, None, 60) == "last poll 12s ago"  # recorded before the rotation read it


def test_a_pass_given_the_liveness_judged_at_its_read_decides_as_one_that_judges_it_itself():
    """decide judges a snapshot's liveness once, as it is read (`remember_doubt`), and hands it to
    `forgettable` and `plan_pass` (issue 42: it was judged three times a pass, ~20 ms each at 10k nodes)."""
    from llmgw.control.decide import forgettable
    from llmgw.placement.liveness import fleet_liveness

    s = fleet_snapshot(["a"], ["b"], [replica("r1", "m", [("a", [0])])])
    own, given = plan_pass(s), plan_pass(s, fleet=fleet_liveness(s))
    assert [d.line() for d in given.decisions] == [d.line() for d in own.decisions]
    assert given.node_status == own.node_status == {"a": "lost", "b": "ready"}
    assert forgettable(s, LOST, fleet_liveness(s)) == forgettable(s, LOST) == ["a"]


async def test_the_liveness_judged_at_a_read_is_handed_on_unless_a_doubt_was_recorded(database_url):
    """`remember_doubt` returns the liveness it judged for the planner to reuse; a blind observer's snapshot
    is changed by it (its `doubted_at` recorded), so then it returns None and the planner judges again."""
    from llmgw.control.liveness import remember_doubt
    from llmgw.db.engine import async_engine

    engine = async_engine(database_url)
    try:
        seen = fleet_snapshot(["a"], ["b"], [replica("r1", "m", [("a", [0])])])
        fleet = await remember_doubt(engine, seen)
        assert fleet is not None and fleet.status("a") == "lost" and seen.liveness.doubted_at is None
        blind = fleet_snapshot(["a", "b"], [], [replica("r1", "m", [("a", [0])])])
        assert await remember_doubt(engine, blind) is None and blind.liveness.doubted_at is not None
    finally:
        await engine.dispose()
