"""The node worker runs an activity only when its origin is proven (security/activity_origin.py): a token
signed by the control plane for this activity, this node, this workflow run and this input. Anything else is
refused before the activity's code runs: non-retryable, logged, counted
(`llmgw_node_activities_refused_total`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from llmgw.security.activity_origin import HEADER, OriginRefused, Verifier

log = logging.getLogger(__name__)


class OriginCheck(Interceptor):
    def __init__(self, verifier: Verifier, node_id: str, refused: Callable[[str, str], None] | None = None):
        self.verifier = verifier
        self.node_id = node_id
        self.refused = refused  # (activity, reason): the metric

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Check(next, self)


class _Check(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, outer: OriginCheck):
        super().__init__(next)
        self.outer = outer

    async def execute_activity(self, input: ExecuteActivityInput):
        info = activity.info()
        payload = input.headers.get(HEADER)
        token = payload.data.decode("utf-8", "replace") if payload is not None else None
        try:
            self.outer.verifier.check(token, activity=info.activity_type, queue=info.task_queue,
                                      workflow_id=info.workflow_id, run_id=info.workflow_run_id,
                                      scheduled=info.scheduled_time, args=input.args)
        except OriginRefused as exc:
            log.warning("node %s refused %s from workflow %s (run %s, queue %s): %s [%s]", self.outer.node_id,
                        info.activity_type, info.workflow_id, info.workflow_run_id, info.task_queue, exc, exc.reason)
            if self.outer.refused is not None:
                self.outer.refused(info.activity_type, exc.reason)
            raise ApplicationError(f"node {self.outer.node_id} refuses {info.activity_type}: {exc}",
                                   exc.reason, type="OriginRefused", non_retryable=True) from None
        return await super().execute_activity(input)
