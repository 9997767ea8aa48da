"""The pure pieces of the operator's view (issue 14): a model's status from its facts, a failure's one-line
cause, bounded refusal reasons, the control worker's gauges, reading an engine log on the node, and AGE."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from llmgw.ctl.output import age
from llmgw.placement.model_status import ModelFacts, ModelStatus, failure_cause, model_condition
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, ReadShardLogInput, ReplicaSnap, Snapshot
from llmgw.telemetry import REFUSAL_REASONS, ControlMetrics, refusal_reason
from llmgw.node.logs import BadShardId, read_log

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
SIGILL = "killed by SIGILL (illegal instruction): the binary uses CPU instructions this machine cannot run"


def model(min_: int = 1, max_: int = 1, **kw) -> Model:
    return Model.model_validate({"name": "m", "scaling": {"min": min_, "max": max_}, "profiles": [{"engine": "sim"}], **kw})


@pytest.mark.parametrize("facts,status", [
    (ModelFacts(replicas={"ready": 1}, failures=3), ModelStatus.READY),
    (ModelFacts(replicas={"starting": 1}, failures=3), ModelStatus.LOADING),
    (ModelFacts(failures=2, backoff_until=NOW + timedelta(seconds=42.2), last_failure=SIGILL), ModelStatus.FAILING),
    (ModelFacts(refused="no node has 8 GPUs"), ModelStatus.UNPLACEABLE),
    (ModelFacts(replicas={"draining": 1}), ModelStatus.STOPPING),
    (ModelFacts(), ModelStatus.PENDING),
])
def test_model_status_from_facts(facts, status):
    c = model_condition(model(), facts, NOW)
    assert c.status == status, c
    if status == ModelStatus.FAILING:
        assert c.reason == SIGILL and c.restarts == 2 and c.retry_in_s == 43
    if status == ModelStatus.LOADING:
        assert "after 3 failed start(s)" in c.reason


def test_loading_is_never_said_without_a_start_and_failing_outranks_a_refusal():
    assert model_condition(model(0, 1), ModelFacts(), NOW).status == ModelStatus.ON_DEMAND
    assert model_condition(model(0, 0), ModelFacts(failures=4), NOW).status == ModelStatus.OFF
    c = model_condition(model(), ModelFacts(failures=1, backoff_until=NOW - timedelta(seconds=5), refused="x"), NOW)
    assert c.status == ModelStatus.FAILING and c.retry_in_s == 0 and c.reason == "its last start failed"
    static = Model.model_validate({"name": "s", "endpoints": ["http://10.0.0.1:8000"]})
    assert model_condition(static, ModelFacts(), NOW).status == ModelStatus.STATIC


def test_failure_cause_is_the_decoded_exit_else_the_first_line():
    assert failure_cause("shard x on n1 exited\nlast output:\nboom", [(1, "n2", "exited with code 1"),
                                                                     (0, "n1", SIGILL)]) == f"{SIGILL} (rank 0 on n1)"
    assert failure_cause("fetch failed: 404 for http://m/w.gguf\nmore", []) == "fetch failed: 404 for http://m/w.gguf"
    assert failure_cause(None) is None and failure_cause("  \n") is None
    assert len(failure_cause("x" * 5000)) == 300


def test_refusal_reasons_are_bounded():
    lines = ["default on n1: needs 2 free GPU(s), 1 of 1 free", "default on n1: has no GPU (needs 2)",
             "default on n2: needs 4 free GPU(s) with 80 GB each; 0 free qualify (cards have 40.0 GB)",
             "default on n3: needs 100 GB of disk for the weights, 12.0 GB free; it does not hold them",
             "default on n4: needs 64 GB of host memory, 8.0 GB free", "default on n5: node is unreachable",
             "default on n6: engine vllm is not available on this node (it has sim)",
             "default on fabric ib-a: 1 node(s) can take a shard (n1), 2 needed", "something new"]
    assert [refusal_reason(x) for x in lines] == ["gpu", "gpu", "gpu_memory", "disk", "memory", "node_unavailable",
                                                  "engine", "fabric", "other"]
    assert {refusal_reason(x) for x in lines} <= set(REFUSAL_REASONS)


def test_control_gauges_follow_the_catalog():
    m = ControlMetrics()
    a, b = model(), Model.model_validate({"name": "b", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]})
    snap = Snapshot(now=NOW, models=[a, b], replicas=[ReplicaSnap(id="r", model="m", profile="default", status="ready")],
                    model_states=[ModelState(name="b", failures=2, backoff_until=NOW + timedelta(seconds=30))])
    m.snapshot(snap)
    text = m.registry.get_sample_value
    assert text("llmgw_replicas", {"model": "m", "status": "ready"}) == 1
    assert text("llmgw_replicas", {"model": "b", "status": "starting"}) == 0
    assert text("llmgw_model_failed_starts", {"model": "b"}) == 2 and text("llmgw_model_backoff_seconds", {"model": "b"}) == 30
    m.snapshot(snap.model_copy(update={"models": [a], "model_states": []}))  # b left the catalog
    assert text("llmgw_model_failed_starts", {"model": "b"}) is None
    m.recorded(["place", "keep"], {"m": ["place m/default on n1: ...", "  default on n2: has no GPU (needs 1)"]}, 0.2)
    assert text("llmgw_placement_refusals_total", {"reason": "gpu"}) == 1
    assert text("llmgw_reconcile_decisions_total", {"kind": "place"}) == 1 and text("llmgw_reconcile_passes_total") == 1


def test_reading_a_log_on_the_node(tmp_path):
    log = tmp_path / "abc-r0.log"
    log.write_bytes("first line\nα β γ\n".encode())
    tail = read_log(tmp_path, "n1", ReadShardLogInput(shard_id="abc-r0", limit=1 << 20))
    assert tail.found and tail.data == "first line\nα β γ\n" and tail.offset == tail.size == log.stat().st_size
    # A read that ends inside a character leaves it whole for the next read.
    part = read_log(tmp_path, "n1", ReadShardLogInput(shard_id="abc-r0", offset=0, limit=12))
    assert part.data == "first line\n" and part.offset == 11
    rest = read_log(tmp_path, "n1", ReadShardLogInput(shard_id="abc-r0", offset=part.offset))
    assert rest.data == "α β γ\n"
    log.write_text("new\n")  # truncated (a new engine wrote it): read from its start
    assert read_log(tmp_path, "n1", ReadShardLogInput(shard_id="abc-r0", offset=rest.offset)).data == "new\n"
    assert not read_log(tmp_path, "n1", ReadShardLogInput(shard_id="none-r0")).found
    for bad in ("../../etc/passwd", "abc-r0/../../x", "abc", "..-r0", "a b-r0", "x" * 200 + "-r0"):
        with pytest.raises(BadShardId):
            read_log(tmp_path, "n1", ReadShardLogInput(shard_id=bad))


def test_age_reads_like_kubectl():
    assert [age(NOW - timedelta(seconds=s), NOW) for s in (5, 119, 600, 3 * 3600 + 120, 30 * 3600, 9 * 86400)] == \
        ["5s", "119s", "10m", "3h2m", "30h", "9d"]
    assert age(None, NOW) == "-" and age((NOW - timedelta(seconds=3)).isoformat(), NOW) == "3s"


def test_a_failing_on_demand_model_nobody_asked_for_since_waits_for_a_request():
    failed = NOW - timedelta(seconds=20)
    facts = ModelFacts(failures=1, backoff_until=NOW + timedelta(seconds=7), last_failure=SIGILL,
                       failed_at=failed, demand_at=failed - timedelta(seconds=10))
    c = model_condition(model(0, 1), facts, NOW)
    assert c.status == ModelStatus.FAILING and c.on_request and c.retry_in_s == 7
    asked = facts.model_copy(update={"demand_at": NOW - timedelta(seconds=1)})
    assert not model_condition(model(0, 1), asked, NOW).on_request
    assert not model_condition(model(1, 1), facts, NOW).on_request  # min 1: the backoff alone paces it


def test_a_serving_model_whose_other_starts_fail_says_so():
    facts = ModelFacts(replicas={"ready": 1}, failures=3, backoff_until=NOW + timedelta(seconds=40),
                       last_failure="…/roll.gguf: no such file")
    c = model_condition(model(1, 1), facts, NOW)
    assert c.status == ModelStatus.READY and c.retry_in_s == 40
    assert c.reason == ("serving; 3 start(s) of another replica failed in a row, the last with: …/roll.gguf: no such "
                        "file; next try in 40s")
    assert model_condition(model(1, 1), ModelFacts(replicas={"ready": 1}), NOW).reason == ""


def test_a_failing_model_s_503_says_the_decoded_cause_and_not_the_engine_s_log():
    from llmgw.http.errors import failing

    err = failing("m", "shard r-r0 on n1 killed by SIGKILL (terminated at once)\nlast output:\n"
                  "7.26.259.014 I slot launch_slot_: id 0 | loading /data/models/x.gguf", 5, 2)
    assert "its replicas failed 2 time(s) in a row (starting or running)" in err.message, err.message
    assert "killed by SIGKILL (terminated at once)" in err.message
    assert "last output" not in err.message and "slot" not in err.message and "x.gguf" not in err.message


@pytest.mark.parametrize("cause,said", [
    ("exited with code 1: prompt: my card is 4111 (rank 0 on n1)", "exited with code 1"),
    ("killed by SIGILL (illegal instruction): the binary uses CPU instructions: ggml_x (rank 0 on n1)",
     "killed by SIGILL (illegal instruction)"),
    ("start on n1: exited with code 2: user said hello\nlast output:\nuser said hello", "start on n1: exited with code 2"),
    ("…/nope.gguf: the mirror answered 404", "…/nope.gguf: the mirror answered 404"),  # ours, not the engine's
    (None, "its start failed"),
])
def test_a_client_is_told_how_an_engine_ended_and_never_what_it_printed(cause, said):
    """Issue 36: a line of an engine's output (a logged prompt of another tenant) reached every client."""
    from llmgw.placement.model_status import client_cause, client_reason

    assert client_cause(cause) == said
    facts = ModelFacts(failures=2, backoff_until=NOW + timedelta(seconds=40), last_failure=cause)
    failing = model_condition(model(0, 1), facts, NOW)
    assert failing.status == ModelStatus.FAILING and client_reason(failing).startswith(said)
    assert failing.reason == (cause or "its last start failed")  # the operator's view keeps it whole
    serving = model_condition(model(1, 1), ModelFacts(replicas={"ready": 1}, **facts.model_dump(exclude={"replicas"})), NOW)
    assert client_reason(serving).startswith(f"serving; 2 start(s) of another replica failed in a row, the last with: {said}")
