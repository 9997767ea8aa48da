"""Task-queue names. The only place one is spelled out (workflow and shard ids: `ids.py`)."""

CONTROL_QUEUE = "llmgw-control"
# Polled by the mirror worker (`llmgw mirror serve`), where the mirror's directory is: `MirrorWorkflow`
# and its activities. One mirror directory per Temporal namespace (several processes may serve it).
MIRROR_QUEUE = "llmgw-mirror"


def node_queue(node_id: str) -> str:
    """The task queue a node worker polls: `node/<node_id>`."""
    return f"node/{node_id}"
