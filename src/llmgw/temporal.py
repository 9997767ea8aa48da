"""Temporal client connection, with the pydantic data converter every llmgw client uses."""

from __future__ import annotations

import asyncio
import logging

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.config import Settings

log = logging.getLogger(__name__)


def workflow_runner():
    """The sandbox every workflow runs in, on the workers and in the replay tests alike. Pydantic and
    OpenTelemetry pass through: payload models keep their identity, and spans made inside workflows reach
    the process's tracer provider rather than a sandboxed no-op one."""
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("pydantic", "opentelemetry"))


async def connect(settings: Settings, attempts: int = 60) -> Client:
    """Connect to `settings.resolved_temporal_address`, retrying for about `attempts` seconds."""
    from llmgw.telemetry import tracing_enabled

    address = settings.resolved_temporal_address
    interceptors = []
    if tracing_enabled():
        from temporalio.contrib.opentelemetry import TracingInterceptor

        # Spans travel in workflow/activity headers: one trace from a pass through the node's activities.
        interceptors.append(TracingInterceptor(always_create_workflow_spans=True))
    last: Exception | None = None
    for i in range(attempts):
        try:
            return await Client.connect(address, namespace=settings.temporal_namespace,
                                        data_converter=pydantic_data_converter, interceptors=interceptors)
        except Exception as exc:  # noqa: BLE001 - RuntimeError from the core SDK on refused connections
            last = exc
            if i == 0:
                log.info("waiting for Temporal at %s", address)
            await asyncio.sleep(1)
    raise SystemExit(f"cannot reach Temporal at {address}: {last}; set LLMGW_TEMPORAL_ADDRESS or run `llmgw dev`")


async def wake_reconciler(client: Client | None, reason: str) -> bool:
    """Signal the reconciler to run a pass now. False (and logged) when it cannot be reached; the
    reconciler's own timer still runs, so a lost wake-up only delays a pass."""
    from llmgw.workflows.queues import RECONCILER_ID

    if client is None:
        return False
    try:
        await client.get_workflow_handle(RECONCILER_ID).signal("wake", reason)
        return True
    except Exception as exc:  # noqa: BLE001 - RPCError when the reconciler is not running yet
        log.warning("could not wake the reconciler (%s): %s", reason, exc)
        return False


class LazyClient:
    """A Temporal client connected in the background, so an HTTP server can start before Temporal."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.client: Client | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        while self.client is None:
            try:
                self.client = await connect(self.settings, attempts=5)
            except SystemExit as exc:
                log.warning("%s", exc)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()

    async def wake(self, reason: str) -> bool:
        return await wake_reconciler(self.client, reason)
