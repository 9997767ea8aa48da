"""The long node activities this agent is running, kept on disk, so that its next boot ends at once those
a crash left open (`end_left`), and Temporal retries them on the new boot within seconds.

Without it, an agent SIGKILLed (or its host rebooted) in the middle of a weight download left the attempt
open until its heartbeat timeout (60 s, options.FETCH); meanwhile the replica waited, and before its
shard was kept across the registration (control/fleet_service.py) it was marked lost and a new replica
placed. Now the new boot fails each attempt its predecessor left, by task token, with `AgentRestarted`
(retryable): the retry lands on this node's queue, which the new boot polls, and resumes the download
from the partial file on disk (weights/download.py). An attempt that has ended meanwhile
(timed out, completed) is simply forgotten.

One small file per attempt (`<state>/shards/<node>/attempts/<hash of token>.json`, 0600: a task token
completes or fails the attempt), written as the attempt begins and removed when it ends, whatever its outcome; a graceful stop removes them too (the
worker's shutdown reports its attempts itself).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

log = logging.getLogger(__name__)
AGENT_RESTARTED = "AgentRestarted"


class Attempts:
    def __init__(self, root: Path):
        self.root = root

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around a long activity's body: its attempt is on disk while it runs."""
        info = activity.info()
        path = self.root / f"{hashlib.sha256(info.task_token).hexdigest()[:32]}.json"
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"token": base64.b64encode(info.task_token).decode(),
                                    "activity": info.activity_type, "workflow": info.workflow_id}))
        except OSError as exc:  # a full disk costs the quick retry after a crash, not the attempt
            log.warning("could not note the %s attempt of %s (%s): after a crash it waits for its heartbeat "
                        "timeout", info.activity_type, info.workflow_id, exc)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def left(self) -> list[tuple[Path, bytes, str]]:
        """(file, task token, what it was) of every attempt a previous boot left on disk."""
        out = []
        for p in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                d = json.loads(p.read_text())
                out.append((p, base64.b64decode(d["token"]), f"{d['activity']} of {d['workflow']}"))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("forgetting an unreadable attempt file %s: %s", p.name, exc)
                p.unlink(missing_ok=True)
        return out


async def end_left(client: Client, attempts: Attempts, node_id: str) -> int:
    """Fail every attempt a previous boot left open (retryable): Temporal retries each at once. Returns how
    many were still open."""
    ended = 0
    for path, token, what in attempts.left():
        try:
            await client.get_async_activity_handle(task_token=token).fail(ApplicationError(
                f"node {node_id}'s agent restarted during this attempt; retried on its new boot",
                type=AGENT_RESTARTED))
            ended += 1
            log.info("ended the %s attempt a previous boot left running; Temporal retries it now", what)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: it ended already (timed out, completed)
                log.warning("could not end the %s attempt a previous boot left (%s); it waits for its heartbeat "
                            "timeout", what, exc)
        path.unlink(missing_ok=True)
    return ended
