"""`BatchWorkflow` (issue 41): one per batch of OpenAI's Batch API, id `batch/<id>`, started by the gateway
that took `POST /v1/batches` (gateway/batches.py). It only orchestrates: each round's activity sends up to
`RunBatchInput.limit` of the batch's unanswered requests through a gateway's own admission, in the batch
band, and commits each answer with its usage (control/batch_activities.py); the last activity writes the
output and error files and the final status. A retried round sends only what has no committed answer, so a
restart of any part repeats no finished request and loses none. Continue-as-new every `ROUNDS_PER_RUN`
rounds (or when Temporal suggests it), so a 50,000-request batch keeps a short history.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.batches import BatchInput, FinishBatchInput, FinishBatchResult, RunBatchInput
    from llmgw.workflows import activities, options
    from llmgw.workflows.queues import CONTROL_QUEUE

ROUNDS_PER_RUN = 20


@workflow.defn(name="BatchWorkflow")
class BatchWorkflow:
    @workflow.run
    async def run(self, inp: BatchInput) -> FinishBatchResult:
        rounds = inp.rounds
        while True:
            done = await workflow.execute_activity(activities.run_batch_requests, RunBatchInput(batch_id=inp.batch_id),
                                                   task_queue=CONTROL_QUEUE, **options.BATCH_ROUND)
            rounds += 1
            if done.ended:
                break
            if rounds - inp.rounds >= ROUNDS_PER_RUN or workflow.info().is_continue_as_new_suggested():
                workflow.continue_as_new(BatchInput(batch_id=inp.batch_id, rounds=rounds))
        return await workflow.execute_activity(activities.finish_batch,
                                               FinishBatchInput(batch_id=inp.batch_id, reason=done.reason),
                                               task_queue=CONTROL_QUEUE, **options.BATCH_FINISH)
