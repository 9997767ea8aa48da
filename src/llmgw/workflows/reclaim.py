"""`ReclaimWorkflow`: compute the cache names the catalog wants, then ask every node to list (default)
or, with `collect`, delete the rest. Each node re-checks every path itself (node/reclaim.py).
Id: `reclaim/<time>`; its result lists, per node, what is unwanted, removed, kept in use, and ignored."""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import NodeReclaimInput, NodeReclaimResult, ReclaimInput, ReclaimResult
    from llmgw.workflows import activities, options
    from llmgw.workflows.queues import CONTROL_QUEUE, node_queue


@workflow.defn(name="ReclaimWorkflow")
class ReclaimWorkflow:
    @workflow.run
    async def run(self, inp: ReclaimInput) -> ReclaimResult:
        targets = await workflow.execute_activity(activities.reclaim_targets, task_queue=CONTROL_QUEUE,
                                                  **options.CONTROL)

        async def one(node_id: str) -> NodeReclaimResult | None:
            try:
                return await workflow.execute_activity(
                    activities.reclaim_cache, NodeReclaimInput(wanted=targets.wanted, collect=inp.collect),
                    task_queue=node_queue(node_id), **options.STOP)
            except ActivityError:
                return None

        results = await asyncio.gather(*(one(n) for n in targets.nodes))
        out = ReclaimResult(collect=inp.collect)
        for node_id, r in zip(targets.nodes, results):
            if r is None:
                out.unreachable.append(node_id)
            else:
                out.nodes.append(r)
        return out
