"""Pre-staging in the planner (issue 39; placement/prestage.py): which idle on-demand model's weights are
fetched ahead, onto which node, and what holds it back. Pure: snapshots in, decisions out. Through the real
processes: tests/test_prestage_e2e.py."""

from __future__ import annotations

from datetime import timedelta

from llmgw.placement.plan import plan_pass
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState
from llmgw.weights.naming import cache_name_for
from tests.fleet import NOW, model, node, replica, snapshot

SRC = "mirror:w.bin"
NAME = cache_name_for(SRC)


def on_demand(name: str = "od", source: str = SRC, disk_gb: float = 40, priority: int = 0, **profile) -> Model:
    """Stopped 30 s after its last use (`idle_timeout`): used a minute ago, it is not running."""
    return model(name, min=0, max=1, priority=priority, idle_timeout=30, source=source, disk_gb=disk_gb,
                 gpus_per_node=1, **profile)


def used(name: str, ago_s: float) -> ModelState:
    return ModelState(name=name, last_used_at=NOW - timedelta(seconds=ago_s))


def staged(models, nodes, replicas=(), states=(), recent_s: float = 3600, budget_gb: float | None = None):
    snap = snapshot(list(models), list(nodes), list(replicas), list(states))
    snap = snap.model_copy(update={"prestage_recent_s": recent_s, "prestage_disk_gb": budget_gb})
    return plan_pass(snap).of_kind("stage")


def test_an_idle_on_demand_model_used_lately_is_staged_where_its_next_start_would_go():
    """n1 holds the weights but is taken by another model: the next start would go to n2, which gets them."""
    busy = replica("r-b", "b", [("n1", [0])])
    [d] = staged([on_demand(), model("b", gpus_per_node=1)], [node("n1", gpus=1, cached=[NAME]), node("n2", gpus=1)],
                 [busy], [used("od", 600)])
    assert d.model == "od" and d.shards[0].node_id == "n2" and d.profile_spec.source == SRC
    assert "last used 600s ago and not running" in d.reason and "40 of no bound GB staged there" in d.reason
    assert d.line().startswith("stage od's weights on n2: ")


def test_nothing_is_staged_where_the_weights_are_for_a_model_running_or_unused_or_used_long_ago():
    nodes = [node("n1", gpus=1), node("n2", gpus=1)]
    assert staged([on_demand()], [node("n1", gpus=1, cached=[NAME])], states=[used("od", 60)]) == []  # held there
    assert staged([on_demand()], nodes, [replica("r1", "od", [("n1", [0])])], [used("od", 60)]) == []  # running
    asleep = replica("r1", "od", [("n1", [0])], status="sleeping")
    assert staged([on_demand()], nodes, [asleep], [used("od", 60)]) == []
    assert staged([on_demand()], nodes) == []  # never used
    assert staged([on_demand()], nodes, states=[used("od", 7200)]) == []  # used before prestage_recent_s
    assert staged([on_demand()], nodes, states=[used("od", 60)], recent_s=0) == []  # off
    assert staged([model("steady", gpus_per_node=1, source=SRC)], nodes, states=[used("steady", 60)]) == []
    assert staged([on_demand(source="org/model-id", engine="vllm")], nodes, states=[used("od", 60)]) == []


def test_a_nodes_budget_counts_weights_of_models_not_running_there():
    other = cache_name_for("mirror:other.bin")
    catalog = [on_demand(disk_gb=40), on_demand("x", source="mirror:other.bin", disk_gb=70)]
    full = node("n1", gpus=1, cached=[other])  # 70 GB of x's weights, x not running: counted
    assert staged(catalog, [full], states=[used("od", 60)], budget_gb=100) == []
    [d] = staged(catalog, [full], states=[used("od", 60)], budget_gb=110)
    assert "110 of 110 GB staged there" in d.reason
    # x running there: its weights are in use, not staged, and do not count.
    running = replica("r-x", "x", [("n1", [1])])
    [d] = staged(catalog, [node("n1", gpus=2, cached=[other])], [running], [used("od", 60)], budget_gb=100)
    assert d.shards[0].node_id == "n1"


def test_stages_are_bounded_per_pass_and_the_most_recently_used_go_first():
    catalog = [on_demand(f"m{i}", source=f"mirror:w{i}.bin") for i in range(6)]
    states = [used(f"m{i}", 100 + i) for i in range(6)]
    ds = staged(catalog, [node("n1", gpus=8)], states=states)
    assert [d.model for d in ds] == ["m0", "m1", "m2", "m3"]


def test_a_model_this_pass_places_is_not_staged_and_a_placement_takes_its_room_first():
    """od is asked for now (placed on n1); ghost was used lately: staged on n2, not where od went."""
    states = [ModelState(name="od", last_used_at=NOW, queued=1), used("ghost", 60)]
    plan = plan_pass(snapshot([on_demand(), on_demand("ghost", source="mirror:g.bin")],
                              [node("n1", gpus=1), node("n2", gpus=1)], [], states)
                     .model_copy(update={"prestage_recent_s": 3600}))
    [p] = plan.of_kind("place")
    [s] = plan.of_kind("stage")
    assert p.model == "od" and s.model == "ghost" and s.shards[0].node_id != p.shards[0].node_id
