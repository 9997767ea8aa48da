"""Derived statuses. One pure function per status, from observed facts only."""

from __future__ import annotations

from datetime import datetime


def node_status(last_heartbeat: datetime | None, now: datetime, unreachable_after_s: float, lost_after_s: float) -> str:
    """`ready`, `unreachable` (stop routing new work to it) or `lost` (rebuild its replicas elsewhere).

    Two stages far apart (seeds 003): a network blip must not tear down replicas that are still serving,
    and rebuilding a multi-node replica costs tens of minutes of loading.
    """
    if last_heartbeat is None:
        return "lost"
    age = (now - last_heartbeat).total_seconds()
    if age >= lost_after_s:
        return "lost"
    if age >= unreachable_after_s:
        return "unreachable"
    return "ready"
