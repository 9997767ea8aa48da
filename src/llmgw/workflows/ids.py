"""Workflow ids and shard ids: the only place either is spelled out (task-queue names: `queues.py`).

Workflow ids are how llmgw finds a lifecycle again (a retried pass, a stop fencing a start, the Temporal
UI's `WorkflowId="replica/<id>/start"`), so each kind has one function and nothing else builds them.
"""

from __future__ import annotations

RECONCILER_ID = "reconciler"
MIRROR_PREFIX = "mirror/"


def shard_id(replica_id: str, rank: int) -> str:
    """`<replica_id>-r<rank>`: one shard of a replica, the name it has on its node and in the database."""
    return f"{replica_id}-r{rank}"


def parse_shard_id(shard: str) -> tuple[str, int] | None:
    """(replica id, rank) of a shard id built by `shard_id`; None for any other text."""
    replica_id, sep, rank = shard.rpartition("-r")
    return (replica_id, int(rank)) if sep and replica_id and rank.isdigit() else None


def replica_of(shard: str) -> str:
    """The replica id in a shard id (`shard` itself when it is not one: an id from before shards)."""
    parsed = parse_shard_id(shard)
    return parsed[0] if parsed else shard


def replica_start_id(replica_id: str) -> str:
    return f"replica/{replica_id}/start"


def replica_stop_id(replica_id: str) -> str:
    return f"replica/{replica_id}/stop"


def replica_sleep_id(replica_id: str) -> str:
    """`replica/<id>/sleep`: one per time a replica goes to sleep (issue 39); a later one reuses the id."""
    return f"replica/{replica_id}/sleep"


def replica_wake_id(replica_id: str) -> str:
    """`replica/<id>/wake`: one per time a sleeping replica is woken."""
    return f"replica/{replica_id}/wake"


def replica_logs_id(replica_id: str, nonce: str) -> str:
    """`replica/<id>/logs/<nonce>`: one short workflow per `ctl logs` read."""
    return f"replica/{replica_id}/logs/{nonce}"


def replica_history_query(replica_id: str) -> str:
    """The visibility query listing a replica's start, stop, sleep and wake workflows."""
    return " OR ".join(f'WorkflowId="{w}"' for w in (replica_start_id(replica_id), replica_stop_id(replica_id),
                                                      replica_sleep_id(replica_id), replica_wake_id(replica_id)))


def stage_id(node_id: str, cache_name: str) -> str:
    """`stage/<node>/<cache name>`: fetching one model's weights onto one node ahead of its start (issue 39)."""
    return f"stage/{node_id}/{cache_name}"


def stage_replica(cache_name: str) -> str:
    """What a staging fetch names as its replica (its download's progress; fencing, which no stop targets)."""
    return f"stage-{cache_name}"


def rollout_id(model: str) -> str:
    """`rollout/<model>`: one rolling replacement per model at a time."""
    return f"rollout/{model}"


def reclaim_id(nonce: str) -> str:
    """`reclaim/<nonce>`: one per `ctl reclaim`."""
    return f"reclaim/{nonce}"


def mirror_workflow_id(name: str, version: str) -> str:
    """`mirror/<name>/<version>`: one workflow per version, whoever asks for it."""
    return f"{MIRROR_PREFIX}{name}/{version}"


def batch_workflow_id(batch_id: str) -> str:
    """`batch/<id>`: one `BatchWorkflow` per batch (issue 41)."""
    return f"batch/{batch_id}"
