"""The compatibility rule for what crosses between llmgw processes, held on the schemas themselves
(docs/operating.md, "Upgrading llmgw"; `schemas/wire.py`).

A fleet runs two versions during every upgrade: a newer control plane drives older agents, and the
reverse. So every model a registered activity or workflow takes or returns, and every body of the node API
both ways (found here from the workers' own registrations, the node API's routes and the type hints, at
every depth, never from a hand list):
- ignores unknown fields: a newer sender's added field must not fail an older receiver. Only models
  written by operators (the catalog's, `OPERATOR_MODULES`) keep `extra="forbid"`, for a typo is an error
  there; on the wire the data converter reads them with unknown fields ignored (tested below, through
  `llmgw.temporal.data_converter(settings)`);
- adds a field only with a default: a field without one is allowed only where the committed baseline
  (`tests/schema_baseline.json`) lists it, and a listed field is never removed (an older receiver
  requires it). Regenerate the baseline only for a model that does not cross processes yet:
  `python -m tests.test_wire_compat`.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.control.worker import WORKFLOWS as CONTROL_WORKFLOWS
from llmgw.mirror.worker import WORKFLOWS as MIRROR_WORKFLOWS
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import LaunchShardInput
from llmgw.security.activity_origin import Signer, Verifier
from llmgw.config import Settings
from llmgw.temporal import data_converter as converter_for
from llmgw.workflows import activities as stubs
from tests.test_activity_stubs import _registered

data_converter = converter_for(Settings())  # what every process builds (no payload key here)

BASELINE = Path(__file__).with_name("schema_baseline.json")
OPERATOR_MODULES = {"llmgw.schemas.catalog", "llmgw.schemas.tenants"}  # written by operators: typos refused


def _hints(fn) -> list:
    hints = typing.get_type_hints(fn)
    return [t for name, t in hints.items()]


def _roots() -> dict[str, list]:
    """Where each type crosses: 'activity <name>' / 'workflow <name>' -> its argument and result types."""
    roots: dict[str, list] = {}
    for fns in _registered().values():
        for fn in fns:
            d = activity._Definition.must_from_callable(fn)
            roots[f"activity {d.name}"] = [*(d.arg_types or []), d.ret_type]
    for cls in CONTROL_WORKFLOWS + MIRROR_WORKFLOWS:
        d = workflow._Definition.must_from_class(cls)
        fns = [d.run_fn, *(s.fn for s in d.signals.values()), *(q.fn for q in d.queries.values())]
        roots[f"workflow {d.name}"] = [t for fn in fns for t in _hints(fn)]
    from fastapi.routing import APIRoute

    from llmgw.control.nodeapi import create_node_api

    for route in create_node_api(None, require_identity=False).app.routes:  # type: ignore[arg-type]
        if isinstance(route, APIRoute):  # what a node sends, and what it reads back
            roots[f"node API {route.path}"] = [*(p.field_info.annotation for p in route.dependant.body_params),
                                               route.response_model]
    return roots


def _models(t, into: dict[type[BaseModel], None]) -> None:
    """Every pydantic model in type `t`, through unions, containers and model fields."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        if t in into:
            return
        into[t] = None
        for f in t.model_fields.values():
            _models(f.annotation, into)
        return
    if isinstance(t, (typing._GenericAlias, types.GenericAlias, types.UnionType)) or typing.get_origin(t):
        for a in typing.get_args(t):
            _models(a, into)


def crossing_models() -> dict[type[BaseModel], None]:
    found: dict[type[BaseModel], None] = {}
    for types_ in _roots().values():
        for t in types_:
            _models(t, found)
    return found


def _name(m: type[BaseModel]) -> str:
    return f"{m.__module__}.{m.__qualname__}"


def required_fields() -> dict[str, list[str]]:
    """model -> its fields without a default, for every crossing model that has any."""
    out = {}
    for m in crossing_models():
        req = sorted(n for n, f in m.model_fields.items() if f.is_required())
        if req:
            out[_name(m)] = req
    return dict(sorted(out.items()))


def test_the_models_are_found_from_the_registrations():
    names = {m.__name__ for m in crossing_models()}
    # one of each kind: an activity input, a node activity result, a workflow input, a query result,
    # and models reached only through fields (a profile inside a launch, an inventory inside a snapshot)
    assert {"LaunchShardInput", "StopShardResult", "ReplicaStartInput", "MirrorProgress", "Profile",
            "ShardPlacement", "Rendezvous", "RegisterRequest", "HeartbeatResponse", "ShardReport"} <= names, names
    assert len(names) > 50


def test_crossing_models_ignore_unknown_fields():
    forbidding = sorted(_name(m) for m in crossing_models()
                        if m.model_config.get("extra") == "forbid" and m.__module__ not in OPERATOR_MODULES)
    assert not forbidding, (f"these models cross processes and refuse unknown fields, so a newer sender fails "
                            f"them: {forbidding}; derive them from schemas/wire.py WireModel")


def test_no_field_without_a_default_beyond_the_baseline():
    baseline: dict[str, list[str]] = json.loads(BASELINE.read_text())
    now = required_fields()
    added = {m: sorted(set(fs) - set(baseline.get(m, []))) for m, fs in now.items()}
    added = {m: fs for m, fs in added.items() if fs}
    assert not added, (f"fields without a default were added to models that cross processes: {added}. An older "
                       "sender leaves them out and this version then fails its payloads: give each a default "
                       "(docs/operating.md, \"Upgrading llmgw\")")
    fields = {_name(m): set(m.model_fields) for m in crossing_models()}
    removed = {m: sorted(set(fs) - fields[m]) for m, fs in baseline.items() if m in fields and set(fs) - fields[m]}
    assert not removed, (f"required fields were removed: {removed}; an older receiver still requires them")


# ---- a newer sender's payload, read by this version -------------------------------------------------

def _newer_launch() -> dict:
    """A `launch_shard` input as a newer control plane might send it: a field this version lacks at the top
    and one inside the catalog profile it carries."""
    inp = LaunchShardInput(shard_id="r1/0", replica_id="r1", model="m", generation=3,
                           profile=Profile(engine="sim", source="sim:x"))
    raw = inp.model_dump(mode="json")
    raw["priority_hint"] = "new in a later version"
    raw["profile"]["kv_cache_dtype"] = "fp8"
    return raw


async def test_an_activity_input_from_a_newer_sender_is_accepted_by_the_data_converter():
    hint = (activity._Definition.must_from_callable(stubs.launch_shard).arg_types or [None])[0]
    assert hint is LaunchShardInput
    raw = _newer_launch()
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(raw).encode())
    [got] = await data_converter.decode([payload], [hint])
    assert got == LaunchShardInput.model_validate({k: v for k, v in raw.items() if k != "priority_hint"},
                                                  extra="ignore")
    assert got.generation == 3 and got.profile.engine == "sim"
    # temporalio's stock converter refuses it: the catalog's Profile forbids unknown fields for operators
    try:
        await pydantic_data_converter.decode([payload], [hint])
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, wrapped or not
        assert "kv_cache_dtype" in str(exc)
    else:
        raise AssertionError("the stock converter was expected to refuse the profile's unknown field")
    # what this version writes is what the stock converter writes: histories are unchanged
    [ours], [stock] = await data_converter.encode([got]), await pydantic_data_converter.encode([got])
    assert ours.data == stock.data


def test_a_newer_senders_signed_input_passes_the_origin_check():
    """The node checks the signed copy of the input against the input it decoded (security/activity_origin.py):
    both read with unknown fields ignored, so a newer control plane's field does not make them differ."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from datetime import datetime, timezone

    key = Ed25519PrivateKey.generate()
    raw = _newer_launch()
    now = datetime.now(timezone.utc)
    token = Signer(key).token("launch_shard", "node/n1", "wf", "run", now, [raw])
    given = LaunchShardInput.model_validate(raw, extra="ignore")
    Verifier([key.public_key()]).check(token, activity="launch_shard", queue="node/n1", workflow_id="wf",
                                       run_id="run", scheduled=now, args=[given])


def test_a_node_api_body_from_a_newer_node_is_accepted():
    from llmgw.schemas.api import HeartbeatRequest, RegisterRequest

    body = {"node_id": "n1", "boot_id": "b", "version": "9.9.0", "inventory": {"cpus": 4, "npu_count": 2},
            "shards": [], "rack": "r7"}
    assert RegisterRequest.model_validate(body).inventory.cpus == 4
    assert HeartbeatRequest.model_validate({"node_id": "n1", "boot_id": "b", "load_avg": 1.5}).node_id == "n1"


if __name__ == "__main__":  # regenerate the baseline (see the module docstring for when)
    BASELINE.write_text(json.dumps(required_fields(), indent=1) + "\n")
    print(f"wrote {BASELINE}")
