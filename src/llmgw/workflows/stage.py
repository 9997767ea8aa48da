"""Pre-staging (issue 39; placement/prestage.py): fetch an on-demand model's weights onto the node its next
start would take, ahead of that start. Id `stage/<node>/<cache name>`, started by `decide` for a pass's
`stage` decisions (never by the reconciler's workflow).

One step: the node's `fetch_weights` (single flight with any start fetching the same weights there, resumed
from its heartbeat, verified like any fetch), with the peers that hold them, tried before the mirror. Nothing
is launched; the file is kept by the reclaim rules like any weights the catalog names, and the next start on
that node finds it ("rung: start from the weights already in its cache").
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import FetchWeightsInput, FetchWeightsResult, StageWeightsInput
    from llmgw.workflows import activities, options
    from llmgw.workflows.ids import stage_replica
    from llmgw.workflows.queues import node_queue


@workflow.defn(name="StageWeightsWorkflow")
class StageWeightsWorkflow:
    @workflow.run
    async def run(self, inp: StageWeightsInput) -> FetchWeightsResult:
        return await workflow.execute_activity(
            activities.fetch_weights,
            FetchWeightsInput(replica_id=stage_replica(inp.cache_name), source=inp.source, peers=inp.peers),
            task_queue=node_queue(inp.node_id), **options.FETCH_TIMED,
        )
