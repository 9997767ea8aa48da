"""`ShardLogWorkflow`: read a shard's engine log on its node (`read_shard_log`, on `node/<node_id>`), for
`llmgw ctl logs`. The log lives on the node; the node worker reads it, so the CLI needs no path on any
disk and no access to the node beyond what the control plane has. A node that does not pick the read up
within seconds is reported as not answering (the admin API then shows the output the node last reported).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import ReadShardLogResult, ShardLogInput
    from llmgw.workflows import activities
    from llmgw.workflows.queues import node_queue

READ = dict(start_to_close_timeout=timedelta(seconds=20), schedule_to_start_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1))


@workflow.defn(name="ShardLogWorkflow")
class ShardLogWorkflow:
    @workflow.run
    async def run(self, inp: ShardLogInput) -> ReadShardLogResult:
        return await workflow.execute_activity(
            activities.read_shard_log, inp.read, task_queue=node_queue(inp.node_id), **READ)
