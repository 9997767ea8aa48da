"""Task-queue names and workflow ids. The only place either is spelled out."""

CONTROL_QUEUE = "llmgw-control"
RECONCILER_ID = "reconciler"
# Polled by the mirror worker (`llmgw mirror serve`), where the mirror's directory is: `MirrorWorkflow`
# and its activities. One mirror directory per Temporal namespace (several processes may serve it).
MIRROR_QUEUE = "llmgw-mirror"
MIRROR_PREFIX = "mirror/"


def node_queue(node_id: str) -> str:
    """The task queue a node worker polls: `node/<node_id>`."""
    return f"node/{node_id}"


def replica_start_id(replica_id: str) -> str:
    return f"replica/{replica_id}/start"


def replica_stop_id(replica_id: str) -> str:
    return f"replica/{replica_id}/stop"


def rollout_id(model: str) -> str:
    """`rollout/<model>`: one rolling replacement per model at a time."""
    return f"rollout/{model}"


def mirror_workflow_id(name: str, version: str) -> str:
    """`mirror/<name>/<version>`: one workflow per version, whoever asks for it."""
    return f"{MIRROR_PREFIX}{name}/{version}"
