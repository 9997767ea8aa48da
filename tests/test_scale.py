"""The scaling rule (placement/scale.py) and what plan_pass does with it: up on load at once, down only by
drain, after the window's peak fits, never within scale_down_delay of the newest replica; queued requests
count; every answer carries its arithmetic."""

from __future__ import annotations

from datetime import timedelta

from llmgw.placement.plan import plan_pass
from llmgw.placement.scale import wanted
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState
from tests.fleet import NOW, node, replica, snapshot


def m(min=1, max=3, target=10, delay=60, engine="sim", **profile) -> Model:
    return Model.model_validate({"name": "m", "scaling": {"min": min, "max": max, "target_in_flight": target,
                                                          "scale_down_delay": delay},
                                 "profiles": [{"engine": engine, **profile}]})


def load(in_flight=0, queued=0, peak=None, **kw) -> ModelState:
    return ModelState(name="m", in_flight=in_flight, queued=queued,
                      peak=in_flight + queued if peak is None else peak, **kw)


def test_scales_up_on_load_at_once_and_counts_queued_requests():
    w = wanted(m(), load(in_flight=12, queued=9), NOW, placed=1)
    assert w.count == 3
    assert "load 21 (12 in flight, 9 queued)" in w.reason and "ceil(21/10) = 3" in w.reason
    assert wanted(m(max=2), load(in_flight=40), NOW, placed=1).count == 2  # never above max
    assert "capped at max 2" in wanted(m(max=2), load(in_flight=40), NOW, placed=1).reason


def test_starting_replicas_count_as_capacity():
    assert wanted(m(), load(in_flight=15), NOW, placed=2).count == 2


def test_scale_down_waits_for_the_window_peak_and_the_delay():
    # load dropped to 3, but the peak over the window still needs 3 replicas at 80 %
    assert wanted(m(), load(in_flight=3, peak=24), NOW, placed=3, newest_age_s=300).count == 3
    # peak fits two (ceil(12/8) = 2): drain one
    w = wanted(m(), load(in_flight=3, peak=12), NOW, placed=3, newest_age_s=300)
    assert w.count == 2 and "ceil(12/(10×0.8)) = 2" in w.reason
    # ... but not within scale_down_delay of the newest replica
    w = wanted(m(), load(in_flight=3, peak=12), NOW, placed=3, newest_age_s=20)
    assert w.count == 3 and w.holding_down and "scale_down_delay 60s" in w.reason


def test_hysteresis_band_keeps_a_replica_between_80_and_100_percent():
    # 2 replicas at 17 in flight: 1 would carry 17 > 10 -> stays 2; at 8 (= 80 % of one) -> 1
    assert wanted(m(), load(in_flight=17), NOW, placed=2, newest_age_s=300).count == 2
    assert wanted(m(), load(in_flight=9), NOW, placed=2, newest_age_s=300).count == 2
    assert wanted(m(), load(in_flight=8), NOW, placed=2, newest_age_s=300).count == 1


def test_never_below_min_and_on_demand_floor():
    assert wanted(m(min=2), load(), NOW, placed=3, newest_age_s=300).count == 2
    od = m(min=0, max=3)
    assert wanted(od, load(), NOW, placed=0).count == 0
    assert wanted(od, load(queued=25), NOW, placed=0).count == 3  # a burst for an unloaded model
    used = ModelState(name="m", last_used_at=NOW - timedelta(seconds=5))
    assert wanted(od, used, NOW, placed=1).count == 1
    # idle past idle_timeout: to zero, even while the peak window still remembers the burst
    idle = ModelState(name="m", last_used_at=NOW - timedelta(seconds=700), peak=25)
    assert wanted(od, idle, NOW, placed=3, newest_age_s=900).count == 0


def test_engine_default_target_comes_from_the_profile():
    assert m(target=None, engine="llamacpp", source="mirror:x.gguf",
             args=["--parallel", "6"]).target_in_flight == 6
    assert m(target=None, engine="vllm", source="org/x").target_in_flight == 32


def test_plan_pass_places_on_load_and_drains_the_newest_when_it_falls():
    nodes = [node("n1", gpus=0, memory_gb=64)]
    busy = snapshot([m(min=1, max=3)], nodes, [replica("r1", "m", [("n1", [])], age_s=600)],
                    states=[load(in_flight=25)])
    plan = plan_pass(busy)
    places = plan.of_kind("place")
    assert len(places) == 2  # both missing replicas in one pass, each accounted before the next
    assert all("ceil(25/10) = 3" in d.reason for d in places)

    quiet = snapshot([m(min=1, max=3)], nodes,
                     [replica("old", "m", [("n1", [])], age_s=600), replica("new", "m", [("n1", [])], age_s=120)],
                     states=[load(in_flight=1)])
    [stop] = plan_pass(quiet).of_kind("stop")
    assert stop.replica_id == "new" and stop.drain


def test_an_on_demand_model_whose_start_failed_waits_for_a_request_since_the_failure():
    od = m(min=0, max=1)
    asked = NOW - timedelta(seconds=30)
    failed = NOW - timedelta(seconds=20)
    # Asked for 30 s ago, and its start failed 20 s later: that demand is spent, well within idle_timeout.
    spent = ModelState(name="m", demand_at=asked, failed_at=failed, failures=1)
    w = wanted(od, spent, NOW, placed=0)
    assert w.count == 0 and "its last start failed 20s ago and nothing has asked for it since" in w.reason
    # A request since the failure (or one waiting now) asks again; so does a use since.
    assert wanted(od, spent.model_copy(update={"demand_at": NOW - timedelta(seconds=5)}), NOW, placed=0).count == 1
    assert wanted(od, spent.model_copy(update={"queued": 1}), NOW, placed=0).count == 1
    assert wanted(od, spent.model_copy(update={"last_used_at": NOW - timedelta(seconds=1)}), NOW, placed=0).count == 1
    # Without a recorded failure (a start reached Ready, or `ctl retry`), the demand counts for idle_timeout.
    assert wanted(od, spent.model_copy(update={"failed_at": None}), NOW, placed=0).count == 1
    # A model with min > 0 is kept at min whatever failed (its backoff paces the retries).
    assert wanted(m(min=1, max=1), spent, NOW, placed=0).count == 1
    # A Ready replica beside one that failed (a scale-up that did not load) keeps its idle_timeout.
    used = ModelState(name="m", last_used_at=NOW - timedelta(seconds=60), failed_at=NOW - timedelta(seconds=10),
                      failures=1)
    assert wanted(m(min=0, max=2), used, NOW, placed=1, newest_age_s=300).count == 1


def test_the_plan_does_not_place_a_failed_on_demand_model_nobody_asked_for_since():
    nodes = [node("n1", gpus=0, memory_gb=64)]
    od = m(min=0, max=1)
    spent = ModelState(name="m", demand_at=NOW - timedelta(seconds=30), failed_at=NOW - timedelta(seconds=20),
                       failures=1, backoff_until=NOW - timedelta(seconds=1))
    plan = plan_pass(snapshot([od], nodes, [], states=[spent]))
    assert not plan.of_kind("place")
    [keep] = [d for d in plan.decisions if d.model == "m"]
    assert "nothing has asked for it since" in keep.reason, keep
    again = spent.model_copy(update={"demand_at": NOW - timedelta(seconds=2)})
    assert len(plan_pass(snapshot([od], nodes, [], states=[again])).of_kind("place")) == 1
