"""Stand-in workflows for workflow-level tests, in a module of their own: the workflow sandbox imports a
workflow's module afresh, and a test module's imports (servers, clients) are not allowed there."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import ReplicaStartInput


@workflow.defn(name="ReplicaStartWorkflow")
class FailingStart:
    """Stands in for a replica start that fails (as one whose weights are missing does)."""

    @workflow.run
    async def run(self, inp: ReplicaStartInput) -> None:
        raise ApplicationError("the weights are missing", non_retryable=True)
