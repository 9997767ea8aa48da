"""Does a profile fit on a node? Resource arithmetic with a reason for every refusal."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import NodeSnap, ReplicaSnap
from llmgw.weights.naming import cache_name_for


def gpus_per_node(profile: Profile) -> int:
    """GPUs one node gives a shard of this profile (0 = a CPU profile).

    vLLM/SGLang: tp × pp spread over `nodes`. llama.cpp: `gpus_per_node` (unset = CPU). sim: like vLLM
    when it plays a tensor-parallel replica, otherwise `gpus_per_node` or CPU.
    """
    if profile.engine in ("vllm", "sglang"):
        return max(1, (profile.tp * profile.pp) // profile.nodes)
    if profile.engine == "sim" and profile.gpus_per_node is None and profile.tp * profile.pp > 1:
        return (profile.tp * profile.pp) // profile.nodes
    return profile.gpus_per_node or 0


@dataclass
class NodeUse:
    """What active replicas already hold on one node."""

    gpus: set[int] = field(default_factory=set)
    memory_mb: int = 0


def node_use(replicas: list[ReplicaSnap], profiles: dict[tuple[str, str], Profile]) -> dict[str, NodeUse]:
    """Sum GPUs and host memory held per node by replicas that still hold resources."""
    use: dict[str, NodeUse] = {}
    for r in replicas:
        if r.status not in ("starting", "ready", "draining"):
            continue
        prof = profiles.get((r.model, r.profile))
        for s in r.shards:
            u = use.setdefault(s.node_id, NodeUse())
            u.gpus.update(s.gpus)
            if prof is not None and prof.memory_gb:
                u.memory_mb += int(prof.memory_gb * 1024)
    return use


def fit_single_node(profile: Profile, node: NodeSnap, use: NodeUse) -> tuple[list[int] | None, str]:
    """Try to place one shard of `profile` on `node`. Returns (gpu indices, "") or (None, reason)."""
    inv = node.inventory
    if node.status != "ready":
        return None, f"node is {node.status}"
    if inv.engines and profile.engine not in inv.engines:
        return None, f"engine {profile.engine} is not available on this node (it has {', '.join(inv.engines)})"
    need_gpus = gpus_per_node(profile)
    holds_weights = bool(profile.source) and cache_name_for(profile.source) in inv.cached_sources
    if profile.disk_gb and not holds_weights and inv.disk_free_mb < profile.disk_gb * 1024:
        return None, f"needs {profile.disk_gb:g} GB of disk for the weights, {inv.disk_free_mb / 1024:.1f} GB free"
    if need_gpus == 0:
        if profile.memory_gb:
            free = inv.memory_mb - use.memory_mb
            if free < profile.memory_gb * 1024:
                return None, f"needs {profile.memory_gb:g} GB of memory, {free / 1024:.1f} GB free"
        return [], ""
    free = [g for g in inv.gpus if g.index not in use.gpus]
    if profile.gpu_memory_gb:
        big = [g for g in free if g.memory_mb >= profile.gpu_memory_gb * 1024]
        if len(big) < need_gpus:
            return None, (f"needs {need_gpus} free GPU(s) with {profile.gpu_memory_gb:g} GB each; "
                          f"{len(big)} of {len(inv.gpus)} qualify")
        free = big
    if len(free) < need_gpus:
        return None, f"needs {need_gpus} free GPU(s), {len(free)} of {len(inv.gpus)} free"
    return pick_gpus(free_indices=[g.index for g in free], peers={g.index: set(g.nvlink_peers) for g in inv.gpus}, count=need_gpus), ""


def pick_gpus(free_indices: list[int], peers: dict[int, set[int]], count: int) -> list[int]:
    """Choose `count` GPUs: a group that are all NVLink peers when the topology is known, else the lowest
    free indices (right on NVSwitch boards; seeds 001 on PCIe bridges pairing specific cards)."""
    free = sorted(free_indices)
    if count <= 1 or not any(peers.values()):
        return free[:count]
    for start in free:
        group = [start]
        for g in free:
            if g != start and all(g in peers.get(h, set()) for h in group):
                group.append(g)
            if len(group) == count:
                return sorted(group)
    return free[:count]
