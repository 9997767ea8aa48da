"""Planner changes injected into a real control worker (`LLMGW_PLANNER_HOOK=tests.planner_hooks:from_file`),
as a deploy with a different planner would bring them. The hook reads `LLMGW_TEST_PLANNER_FILE` every pass:

- `{"hold": ["m"]}`: model `m` is never placed (its place decisions become `wait`, "held by the test hook");
- `{"fail": "text"}`: the planner raises `RuntimeError(text)`;
- `{}` or no file: the planner as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmgw.placement.decisions import Decision, Plan
from llmgw.schemas.payloads import Snapshot


def from_file(snapshot: Snapshot, plan: Plan) -> Plan:
    path = Path(os.environ["LLMGW_TEST_PLANNER_FILE"])
    change = json.loads(path.read_text()) if path.exists() else {}
    if change.get("fail"):
        raise RuntimeError(change["fail"])
    hold = set(change.get("hold", []))
    decisions = [Decision(kind="wait", model=d.model, reason="held by the test hook", refusals=d.refusals)
                 if d.kind == "place" and d.model in hold else d for d in plan.decisions]
    return plan.model_copy(update={"decisions": decisions})
