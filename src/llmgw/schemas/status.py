"""Replica and shard statuses: the values, their groups and their transitions, defined once.

A `StrEnum` serialises to the plain strings stored in Postgres and recorded in workflow histories
("starting", "ready", ...), so typing a field with it changes no row and no payload.

    starting ──> ready ──> draining ──> stopped
        │        │  ▲          │
        │        ▼  │ (wake)   │
        │      sleeping ───────┤
        └────────────┴─────────┴──────> failed | lost

A replica holds its node's GPUs, memory and disk while starting, ready, sleeping or draining (`holding`),
and an ended one until every shard was asked to stop (settled). A step towards stopping (draining or an
end) bumps the replica's fencing generation (`fences`), so a launch read before it is refused; going to
sleep and waking are no such step (the engine lives on, and a stop while it sleeps fences it as any stop).

`sleeping` (issue 39): its engine process lives on with its accelerator memory released (vLLM's sleep
mode, SGLang's memory release, the sim engine's); it is not routed, and the planner may hand its GPUs to
another replica (evicting it: placement/sleep.py). Waking it makes it `ready` again, same process.
"""

from __future__ import annotations

from enum import StrEnum


class ReplicaStatus(StrEnum):
    STARTING = "starting"  # placed; its start workflow fetches, launches and waits for Ready
    READY = "ready"  # routed
    DRAINING = "draining"  # not routed; the requests it serves finish, then it stops
    SLEEPING = "sleeping"  # not routed; its engine lives on with its accelerator memory released (woken: ready)
    STOPPED = "stopped"  # ended on purpose
    FAILED = "failed"  # ended: its engine failed (a start that failed, an engine that exited)
    LOST = "lost"  # ended: its node was lost, or stopped its engines on its own

    @classmethod
    def ended(cls) -> frozenset[ReplicaStatus]:
        return _ENDED

    @classmethod
    def holding(cls) -> frozenset[ReplicaStatus]:
        """Statuses that hold GPUs, memory and disk on their nodes."""
        return _HOLDING

    @classmethod
    def live(cls) -> frozenset[ReplicaStatus]:
        """Serving or about to: what a rollout counts as the model's current replicas."""
        return _LIVE

    @classmethod
    def fencing(cls) -> frozenset[ReplicaStatus]:
        """Steps towards stopping: each bumps the fencing generation."""
        return _FENCING

    @property
    def is_ended(self) -> bool:
        return self in _ENDED

    @property
    def wanted_by_start(self) -> bool:
        """Whether its start may still fetch or launch ("still wanted?", asked by the start workflow and by
        the node before a launch): only while it is starting."""
        return self is ReplicaStatus.STARTING

    def sources(self) -> tuple[ReplicaStatus, ...]:
        """The statuses a replica may move to this one from."""
        return _SOURCES[self]

    def can_become(self, target: ReplicaStatus | str) -> bool:
        return self in _SOURCES[ReplicaStatus(target)]


_ENDED = frozenset({ReplicaStatus.STOPPED, ReplicaStatus.FAILED, ReplicaStatus.LOST})
_HOLDING = frozenset({ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.SLEEPING, ReplicaStatus.DRAINING})
_LIVE = frozenset({ReplicaStatus.STARTING, ReplicaStatus.READY})
_FENCING = frozenset({ReplicaStatus.DRAINING, *_ENDED})
_SOURCES: dict[ReplicaStatus, tuple[ReplicaStatus, ...]] = {
    ReplicaStatus.STARTING: (),
    # From sleeping only by waking (`fleet_repo.wake_replica`); a node's "ready" push applies to a start only.
    ReplicaStatus.READY: (ReplicaStatus.STARTING, ReplicaStatus.SLEEPING),
    ReplicaStatus.SLEEPING: (ReplicaStatus.READY,),
    ReplicaStatus.DRAINING: (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.SLEEPING),
    ReplicaStatus.STOPPED: (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.SLEEPING, ReplicaStatus.DRAINING),
    ReplicaStatus.FAILED: (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.SLEEPING, ReplicaStatus.DRAINING),
    ReplicaStatus.LOST: (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.SLEEPING, ReplicaStatus.DRAINING),
}


def wanted_by_start(status: str | None) -> bool:
    """"Still wanted?" for a stored status that may be missing (no such replica: not wanted)."""
    return status == ReplicaStatus.STARTING


class ShardStatus(StrEnum):
    """A shard's status, as its node reports it (`ShardReport.state`) and as stored. A report moves it
    forward only (`step`): once ended, ended, and the first end is its cause."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"

    @property
    def step(self) -> int:
        return _SHARD_STEP[self]

    @property
    def is_ended(self) -> bool:
        return _SHARD_STEP[self] == 3


_SHARD_STEP = {ShardStatus.STARTING: 0, ShardStatus.READY: 1, ShardStatus.DRAINING: 2, ShardStatus.STOPPED: 3,
               ShardStatus.FAILED: 3, ShardStatus.LOST: 3}
