"""The control worker signs every activity its workflows schedule on a node's queue (security/activity_origin.py).

A workflow outbound interceptor: the workflow code is unchanged, and replay is unaffected (the signature is
deterministic and headers are not compared on replay). The class is made outside the workflow sandbox and
holds the signer; the sandbox passes interceptor classes in as they are."""

from __future__ import annotations

from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.worker import (
    Interceptor, StartActivityInput, WorkflowInboundInterceptor, WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from llmgw.security.activity_origin import HEADER, Signer
from llmgw.workflows.queues import node_queue

NODE_PREFIX = node_queue("")


def origin_payload(token: str) -> Payload:
    return Payload(metadata={"encoding": b"binary/plain"}, data=token.encode())


class OriginSigning(Interceptor):
    def __init__(self, signer: Signer):
        self.signer = signer

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        signer = self.signer

        class _Outbound(WorkflowOutboundInterceptor):
            def start_activity(self, input: StartActivityInput):
                if input.task_queue and input.task_queue.startswith(NODE_PREFIX):
                    info = workflow.info()
                    token = signer.token(input.activity, input.task_queue, info.workflow_id, info.run_id,
                                         workflow.now(), input.args)
                    input.headers = {**input.headers, HEADER: origin_payload(token)}
                return super().start_activity(input)

        class _Inbound(WorkflowInboundInterceptor):
            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(_Outbound(outbound))

        return _Inbound
