"""The mirror process (`llmgw mirror serve`): the byte listener nodes fetch weights from, and the mirror
worker, which polls `llmgw-mirror` and runs `MirrorWorkflow` with its activities, where the mirror's
directory is (a download written anywhere else would have to be copied here again).

The listener does not wait for Temporal: nodes fetch from the mirror whatever state the control plane
is in, so the worker connects in the background and keeps trying. Heartbeats reach Temporal at most
every 2 s (rather than the SDK's default of up to 0.8 x the heartbeat timeout), so a cancel reaches a
download within seconds and a resumed one starts from a recent point.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from pathlib import Path

from temporalio.worker import Worker

from llmgw.mirror.activities import MirrorActivities
from llmgw.config import Settings
from llmgw.http.serving import Listener, listener_limits, serve
from llmgw.telemetry import MirrorMetrics
from llmgw.temporal import connect, workflow_runner
from llmgw.weights.download import Limits
from llmgw.mirror.server import create_mirror_app
from llmgw.weights.urls import AddressPolicy
from llmgw.workflows.mirror import MirrorWorkflow
from llmgw.workflows.queues import MIRROR_QUEUE

log = logging.getLogger(__name__)
WORKFLOWS = [MirrorWorkflow]


async def run_mirror(settings: Settings, directory: Path, port: int, stop: asyncio.Event) -> None:
    """Serve `directory` on `port` and, unless `mirror_worker` is off, run the mirror worker, until `stop`."""
    try:
        policy = AddressPolicy.parse(settings.mirror_private_sources)
    except ValueError as exc:
        raise SystemExit(f"LLMGW_MIRROR_PRIVATE_SOURCES: {exc} (write CIDRs or addresses, comma-separated, "
                         "or 'private')") from None
    metrics = MirrorMetrics()
    app = create_mirror_app(directory, metrics)
    worker = None
    if settings.mirror_worker:
        acts = MirrorActivities(directory, policy, Limits.from_settings(settings), metrics)
        worker = asyncio.create_task(_work(settings, acts, stop), name="mirror worker")
    try:
        await serve([Listener(app, settings.host, port, "mirror", lifespan="off",
                              limits=listener_limits(settings, 64 << 10))], stop)
    finally:
        stop.set()
        if worker is not None:
            try:
                await asyncio.wait_for(worker, 15)
            except Exception:  # noqa: BLE001 - stopping anyway
                log.exception("mirror worker did not stop cleanly")


async def _work(settings: Settings, acts: MirrorActivities, stop: asyncio.Event) -> None:
    client = None
    while client is None and not stop.is_set():
        try:
            client = await connect(settings, attempts=10)
        except SystemExit as exc:
            log.warning("mirror worker: %s; still trying", exc)
    if client is None:
        return
    worker = Worker(client, task_queue=MIRROR_QUEUE, workflows=WORKFLOWS, activities=acts.all(),
                    workflow_runner=workflow_runner(), max_concurrent_activities=64,
                    max_heartbeat_throttle_interval=timedelta(seconds=2),
                    default_heartbeat_throttle_interval=timedelta(seconds=2))
    async with worker:
        log.info("mirror worker polling %s for %s", MIRROR_QUEUE, acts.root)
        await stop.wait()
