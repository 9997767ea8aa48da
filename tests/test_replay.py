"""Every committed workflow history replays against today's workflow code (issue 10).

The histories under `tests/histories/<version>/` were exported from real runs of earlier code
(`tests/histories/capture.py` says how). Workflows started by that code may still be running in a
deployment when this code is rolled out: a change that makes any of them non-deterministic fails here, and
must be versioned with `workflow.patched(...)` (docs/architecture.md, "Changing workflow code").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from llmgw.temporal import workflow_runner
from llmgw.control.worker import WORKFLOWS as CONTROL_WORKFLOWS
from llmgw.mirror.worker import WORKFLOWS as MIRROR_WORKFLOWS

WORKFLOWS = CONTROL_WORKFLOWS + MIRROR_WORKFLOWS  # every workflow some llmgw worker runs

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*/*.json"))


def _workflow_id(path: Path) -> str:
    return path.name.split("--")[1]


def test_histories_are_committed():
    kinds = {json.loads(p.read_text())["events"][0]["workflowExecutionStartedEventAttributes"]["workflowType"]["name"]
             for p in HISTORIES}
    assert {"ReconcilerWorkflow", "ReplicaStartWorkflow", "ReplicaStopWorkflow", "MirrorWorkflow"} <= kinds, kinds


@pytest.mark.parametrize("path", HISTORIES, ids=[f"{p.parent.name}/{p.stem}" for p in HISTORIES])
async def test_history_replays(path: Path):
    history = WorkflowHistory.from_json(_workflow_id(path), path.read_text())
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter, workflow_runner=workflow_runner(sandbox_own_modules=True))
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
