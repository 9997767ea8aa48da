"""Tracing through the real processes: a replica's start is one trace from the reconciler's pass
through the control worker's workflow to the node worker's fetch, launch and readiness activities."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def spans(d) -> list[dict]:
    out = []
    for f in d.glob("*.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def test_replica_start_is_one_trace_across_worker_and_node(tmp_path, database_url, temporal, namespace):
    from tests.helpers import ControlPlane

    trace_dir = tmp_path / "traces"
    cp = ControlPlane(tmp_path, database_url, temporal.address, LLMGW_TEMPORAL_NAMESPACE=namespace,
                      LLMGW_TRACING=f"file:{trace_dir}")
    try:
        cp.start()
        cp.agent("n1")
        cp.apply({"models": [{"name": "sim-a", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}]})
        [rep] = cp.wait_replicas("sim-a")

        def node_spans():
            s = spans(trace_dir)
            names = {(x["service"], x["name"]) for x in s}
            done = {("llmgw-agent", "RunActivity:wait_shard_ready"), ("llmgw-worker", "RunWorkflow:ReplicaStartWorkflow"),
                    ("llmgw-worker", "reconcile pass")}
            return s if done <= names else None

        all_spans = wait_until(node_spans, timeout_s=20, what="node activity spans")
        start = next(s for s in all_spans if s["name"] == "RunWorkflow:ReplicaStartWorkflow"
                     and s["attributes"].get("temporalWorkflowID") == f"replica/{rep['id']}/start")
        trace = [s for s in all_spans if s["trace_id"] == start["trace_id"]]
        node = {s["name"] for s in trace if s["service"] == "llmgw-agent"}
        assert {"RunActivity:start_shard", "RunActivity:wait_shard_ready"} <= node  # fetch and launch: one node step
        passes = [s for s in trace if s["name"] == "reconcile pass"]
        assert any(any("place sim-a/default on n1" in d for d in p["attributes"]["llmgw.decisions"]) for p in passes)
    finally:
        cp.stop()
