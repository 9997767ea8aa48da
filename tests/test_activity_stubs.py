"""Workflows call activities through the typed stubs of `llmgw.workflows.activities` (issue 34).

- Each stub has exactly one implementation, registered by the worker its list names (the control worker's
  `activities()`, `NodeActivities.all()`, `MirrorActivities.all()`), with the same activity name and the
  same input and result annotations; and every registered activity has a stub.
- No workflow calls an activity by a string name or repeats a `result_type`.
- The activities whose bare `str`/`int` became a model still read what older code wrote: an old workflow
  (or a committed history) schedules `record_replica_failure`/`reset_model_failures` with the model's
  name alone, and an old node answers `drain_shard` with the bare count, which a workflow replaying an old
  history decodes with today's result type. Decoded here through the pydantic data converter, from the
  committed histories' own payloads too.
"""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.control import worker as control_worker
from llmgw.control.activities import ControlActivities
from llmgw.control.decide import DecideActivities
from llmgw.mirror.activities import MirrorActivities
from llmgw.node.activities import NodeActivities
from llmgw.schemas.payloads import (
    DrainShardInput, DrainShardResult, RecordReplicaFailureInput, ResetModelFailuresInput, WaitShardReadyInput,
)
from llmgw.control.batch_activities import BatchActivities
from llmgw.workflows import activities as stubs
from tests.helpers import parse_source

WORKFLOWS = Path(__file__).resolve().parent.parent / "src" / "llmgw" / "workflows"
HISTORIES = sorted((Path(__file__).parent / "histories").glob("*/*.json"))


def _registered() -> dict[str, list]:
    """What each worker registers, read from the lists the workers themselves use (no I/O is done: the
    objects are never run)."""
    control = ControlActivities(None, 30.0, 60.0)  # type: ignore[arg-type]
    decide = DecideActivities(None, control.settings, control.read_snapshot)  # type: ignore[arg-type]
    return {
        "control": control_worker.activities(control, decide, BatchActivities(None, control.settings)),  # type: ignore[arg-type]
        "node": NodeActivities(None).all(),  # type: ignore[arg-type]  (node/agent.py registers this list)
        "mirror": MirrorActivities(None, None, None).all(),  # type: ignore[arg-type]  (mirror/worker.py)
    }


STUBS = {"control": stubs.CONTROL, "node": stubs.NODE, "mirror": stubs.MIRROR}


def _defn(fn) -> activity._Definition:
    return activity._Definition.must_from_callable(fn)


@pytest.mark.parametrize("worker", sorted(STUBS))
def test_each_stub_has_one_implementation_with_the_same_types(worker: str):
    impls: dict[str, list] = {}
    for fn in _registered()[worker]:
        impls.setdefault(_defn(fn).name, []).append(fn)
    assert not [n for n, fns in impls.items() if len(fns) > 1], "registered twice"
    names = [_defn(s).name for s in STUBS[worker]]
    assert sorted(names) == sorted(impls), f"{worker}: stubs and registrations differ"
    for stub in STUBS[worker]:
        want, got = _defn(stub), _defn(impls[_defn(stub).name][0])
        assert stub.__name__ == want.name  # the stub is called by its activity's name
        assert (got.arg_types, got.ret_type) == (want.arg_types, want.ret_type), want.name


def test_every_stub_is_on_one_worker_list():
    defined = {v for v in vars(stubs).values() if callable(v) and activity._Definition.from_callable(v)}
    listed = [s for group in STUBS.values() for s in group]
    assert len(listed) == len(set(listed)) and set(listed) == defined


def test_workflows_call_activities_by_stub():
    """No `execute_activity("name", ...)` and no `result_type=`: the stub gives both."""
    calls = {"execute_activity", "start_activity", "execute_local_activity", "start_local_activity"}
    bad = []
    for path in sorted(WORKFLOWS.glob("*.py")):
        for node in ast.walk(parse_source(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls:
                if node.args and isinstance(node.args[0], ast.Constant) or any(
                        k.arg in ("result_type", "activity") for k in node.keywords):
                    bad.append(f"{path.name}:{node.lineno}")
    assert not bad


# ---- payloads older code wrote ------------------------------------------------------------------------

async def _decode(payload: Payload, type_hint: type):
    [value] = await pydantic_data_converter.decode([payload], [type_hint])
    return value


async def _old(value) -> Payload:
    """`value` as older code sent it (the same converter, the bare value)."""
    [payload] = await pydantic_data_converter.encode([value])
    return payload


@pytest.mark.parametrize("stub, model", [(stubs.record_replica_failure, RecordReplicaFailureInput),
                                         (stubs.reset_model_failures, ResetModelFailuresInput)])
async def test_an_old_bare_model_name_input_still_decodes(stub, model):
    [arg_type] = _defn(stub).arg_types or []
    assert arg_type is model
    got = await _decode(await _old("big-model"), arg_type)
    assert got == model(model="big-model")
    new = await pydantic_data_converter.encode([model(model="big-model")])
    assert json.loads(new[0].data) == {"model": "big-model"}  # what this version sends
    assert await _decode(new[0], arg_type) == got


async def test_an_old_bare_drain_count_still_decodes():
    ret_type = _defn(stubs.drain_shard).ret_type
    assert ret_type is DrainShardResult
    assert await _decode(await _old(3), ret_type) == DrainShardResult(in_flight=3)
    assert await _decode(await _old(0), ret_type) == DrainShardResult(in_flight=0)
    new = await pydantic_data_converter.encode([DrainShardResult(in_flight=2)])
    assert await _decode(new[0], ret_type) == DrainShardResult(in_flight=2)


async def test_drain_inputs_read_both_ways():
    """A node of this version reads what an older workflow scheduled (`WaitShardReadyInput`), and an older
    node reads what this version's workflow schedules (the same fields)."""
    old = await pydantic_data_converter.encode([WaitShardReadyInput(shard_id="r/0", timeout_s=12.5)])
    assert await _decode(old[0], DrainShardInput) == DrainShardInput(shard_id="r/0", timeout_s=12.5)
    new = await pydantic_data_converter.encode([DrainShardInput(shard_id="r/0", timeout_s=12.5)])
    assert await _decode(new[0], WaitShardReadyInput) == WaitShardReadyInput(shard_id="r/0", timeout_s=12.5)


def _payload(raw: dict) -> Payload:
    return Payload(metadata={k: base64.b64decode(v) for k, v in raw.get("metadata", {}).items()},
                   data=base64.b64decode(raw.get("data", "")))


def _history_payloads() -> dict[tuple[str, str], list[Payload]]:
    """(activity name, "input"/"result") -> every payload the committed histories hold for it."""
    found: dict[tuple[str, str], list[Payload]] = {}
    for path in HISTORIES:
        names: dict[str, str] = {}
        for e in json.loads(path.read_text())["events"]:
            if a := e.get("activityTaskScheduledEventAttributes"):
                names[e["eventId"]] = a["activityType"]["name"]
                for p in (a.get("input") or {}).get("payloads", []):
                    found.setdefault((a["activityType"]["name"], "input"), []).append(_payload(p))
            elif c := e.get("activityTaskCompletedEventAttributes"):
                for p in (c.get("result") or {}).get("payloads", []):
                    found.setdefault((names[c["scheduledEventId"]], "result"), []).append(_payload(p))
    return found


async def test_committed_histories_payloads_decode_with_the_stubs_types():
    """Every input and result recorded in tests/histories decodes with today's stub annotations: results
    are what a replaying workflow decodes; inputs are what a retried or late activity task carries."""
    found = _history_payloads()
    by_name = {_defn(s).name: _defn(s) for group in STUBS.values() for s in group}
    assert {("drain_shard", "result"), ("record_replica_failure", "input"),
            ("reset_model_failures", "input")} <= set(found)
    for (name, kind), payloads in sorted(found.items()):
        d = by_name[name]
        hint = d.ret_type if kind == "result" else (d.arg_types or [None])[0]
        for p in payloads:
            await _decode(p, hint)  # raises if an old shape no longer reads
    assert {(await _decode(p, DrainShardResult)).in_flight for p in found[("drain_shard", "result")]} == {0}
