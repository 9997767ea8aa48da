"""Does one shard of a profile fit on one node? Resource arithmetic with a reason for every refusal.

Rules (seeds 000 "Refuse a node with no room", 001 "Stop trusting hardware facts", 003 "Place llama.cpp
across several GPUs"):
- the node must be Ready (not Unreachable or Lost) and able to launch the engine;
- disk room for the weights, skipped on a node that already holds them (holding the file is what used the
  space, so without the skip the best-placed node is the one most likely refused); weights that starting
  replicas are still fetching count as used;
- GPUs: `gpus_per_shard` free cards, each with `gpu_memory_gb`; a group of NVLink peers when the topology
  is known, else the lowest free indices;
- host memory (`memory_gb`), which is what a CPU-only profile is placed by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import NodeSnap, ReplicaSnap
from llmgw.schemas.status import ReplicaStatus
from llmgw.weights.naming import cache_name_for


@dataclass
class NodeUse:
    """What active replicas already hold on one node.

    `gpus` maps a held GPU index to the model holding it; `memory_mb` is host memory promised to shards
    (and what sleeping replicas hold asleep);
    `disk_mb` is weights that starting replicas are fetching and the node's free-disk figure may not show
    yet; `shards` counts shards (the load used to break ties).
    """

    gpus: dict[int, str] = field(default_factory=dict)
    memory_mb: int = 0
    disk_mb: int = 0
    shards: int = 0
    _held: str | None = field(default=None, repr=False, compare=False)  # `held()`, once written

    def held(self) -> str:
        """` (held: MODEL on 0,1; ...)` for the refusal texts ("" when no GPU is held). Written once: a use is
        not changed after nodes have been judged against it (`FleetView` makes a new one)."""
        if self._held is None:
            by_model: dict[str, list[str]] = {}
            for g in sorted(self.gpus):
                by_model.setdefault(self.gpus[g], []).append(str(g))
            self._held = "" if not by_model else (
                " (held: " + "; ".join(f"{m} on {','.join(by_model[m])}" for m in sorted(by_model)) + ")")
        return self._held


@lru_cache(maxsize=4096)
def cache_name(source: str) -> str:
    """`cache_name_for`, remembered: a sha256 per source, not per node and trial."""
    return cache_name_for(source)


@lru_cache(maxsize=1024)
def _cards(sizes_mb: tuple[int, ...]) -> str:
    return ", ".join(_gb(m) for m in sorted(set(sizes_mb)))


def holds_weights(profile: Profile, node: NodeSnap) -> bool:
    """True when the node's cache already has the profile's source (by cache name, seeds 000)."""
    return bool(profile.source) and cache_name(profile.source) in node.inventory.cached_sources


def node_use(replicas: list[ReplicaSnap], profiles: dict[tuple[str, str], Profile],
             nodes: dict[str, NodeSnap] | None = None) -> dict[str, NodeUse]:
    """Sum, per node id, what replicas hold: those in `ReplicaStatus.holding()` statuses, and ended ones not yet settled,
    whose shards may still be running (a failed replica's other shards hold their GPUs until stopped).
    `profiles` maps (model, profile name) to the profile; `nodes` (by id) lets weights still being
    fetched count against the node's disk."""
    use: dict[str, NodeUse] = {}
    for r in replicas:
        if r.status not in ReplicaStatus.holding() and r.settled:
            continue
        prof = profiles.get((r.model, r.profile))
        for s in r.shards:
            u = use.get(s.node_id)
            if u is None:
                u = use[s.node_id] = NodeUse()
            u.shards += 1
            for g in s.gpus:
                u.gpus[g] = r.model
            if prof is None:
                continue
            if prof.memory_gb:
                u.memory_mb += int(prof.memory_gb * 1024)
            if r.status == ReplicaStatus.SLEEPING:  # its weights, offloaded from the GPUs (placement/sleep.py)
                u.memory_mb += prof.sleep_host_mb()
            if r.status == ReplicaStatus.STARTING and prof.disk_gb and nodes:
                node = nodes.get(s.node_id)
                if node is not None and not holds_weights(prof, node):
                    u.disk_mb += int(prof.disk_gb * 1024)
    return use


@dataclass
class NodeFit:
    """One node judged for one shard of one profile.

    `gpus` is the chosen GPU indices ([] on CPU) or None when refused; `reason` says why it was refused
    (written out when first read: the eviction search judges thousands of nodes whose reasons nobody reads).
    `nvlink`: True when the chosen GPUs are all NVLink peers, False when the topology is known and no
    free group of peers was left (the lowest free indices were taken instead), None when it does not apply
    or the topology is unknown.
    """

    node: NodeSnap
    gpus: list[int] | None
    why: Callable[[], str] | None = None
    holds_weights: bool = False
    nvlink: bool | None = None
    load: int = 0
    _reason: str | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.gpus is not None

    @property
    def reason(self) -> str:
        if self._reason is None:
            self._reason = self.why() if self.why is not None else ""
        return self._reason

    def preference(self) -> tuple:
        """Sort key, best first: holds the weights, GPUs on NVLink, least loaded, then by id."""
        return (0 if self.holds_weights else 1, 1 if self.nvlink is False else 0, self.load, self.node.id)

    def remark(self) -> str:
        """What a placement on this node should say about it."""
        parts = ["holds the weights" if self.holds_weights else "least loaded"]
        if self.nvlink:
            parts.append("GPUs on NVLink")
        elif self.nvlink is False:
            parts.append("no free NVLink group, lowest free GPUs")
        return ", ".join(parts)


def _gb(mb: float) -> str:
    return f"{mb / 1024:.1f} GB"


def fit_node(profile: Profile, node: NodeSnap, use: NodeUse | None = None, holds: bool | None = None) -> NodeFit:
    """Judge `node` (its status already derived) for one shard of `profile`. Never raises. `holds`:
    whether the node holds the profile's weights, when the caller knows (else it is looked up)."""
    use = use or _NO_USE
    inv = node.inventory
    if holds is None:
        holds = holds_weights(profile, node)

    def refuse(why: Callable[[], str]) -> NodeFit:
        return NodeFit(node, None, why, holds, load=use.shards)

    if node.status != "ready":
        return refuse(lambda: f"node is {node.status}")
    if inv.engines and profile.engine not in inv.engines:
        return refuse(lambda: f"engine {profile.engine} is not available on this node (it has {', '.join(inv.engines)})")
    if profile.disk_gb and not holds:
        free_disk = inv.disk_free_mb - use.disk_mb
        if free_disk < profile.disk_gb * 1024:
            def no_disk() -> str:
                pending = f", {_gb(use.disk_mb)} of it promised to weights being fetched" if use.disk_mb else ""
                return (f"needs {profile.disk_gb:g} GB of disk for the weights, {_gb(max(free_disk, 0) + use.disk_mb)} "
                        f"free{pending}; it does not hold them")
            return refuse(no_disk)
    if profile.memory_gb:
        free_mem = inv.memory_mb - use.memory_mb
        if free_mem < profile.memory_gb * 1024:
            return refuse(lambda: f"needs {profile.memory_gb:g} GB of host memory, {_gb(max(free_mem, 0))} free")
    need = profile.gpus_per_shard
    if need == 0:
        return NodeFit(node, [], None, holds, load=use.shards)
    if not inv.gpus:
        return refuse(lambda: f"has no GPU (needs {need})")
    free = [g for g in inv.gpus if g.index not in use.gpus]
    if profile.gpu_memory_gb:
        big = [g for g in free if g.memory_mb >= profile.gpu_memory_gb * 1024]
        if len(big) < need:
            def too_small() -> str:
                cards = _cards(tuple(g.memory_mb for g in inv.gpus))
                return (f"needs {need} free GPU(s) with {profile.gpu_memory_gb:g} GB each; {len(big)} free "
                        f"qualify (cards have {cards}){use.held()}")
            return refuse(too_small)
        free = big
    if len(free) < need:
        return refuse(lambda: f"needs {need} free GPU(s), {len(free)} of {len(inv.gpus)} free{use.held()}")
    peers = {g.index: set(g.nvlink_peers) for g in inv.gpus} if need > 1 else {}  # one card needs no peers
    gpus, nvlink = pick_gpus([g.index for g in free], peers, need)
    return NodeFit(node, gpus, None, holds, nvlink, use.shards)


_NO_USE = NodeUse()


def pick_gpus(free_indices: list[int], peers: dict[int, set[int]], count: int) -> tuple[list[int], bool | None]:
    """Choose `count` GPUs from `free_indices`. Returns (indices, nvlink).

    When the NVLink topology is known (any GPU lists a peer), the first group, from the lowest index,
    whose members are all peers of each other: (group, True). When none is free: the lowest free indices
    and False, so the caller can prefer another node and say why. Unknown topology (no peers anywhere, as
    on an NVSwitch board seen without NVML): the lowest free indices and None (seeds 001).
    """
    free = sorted(free_indices)
    if count <= 1 or not any(peers.values()):
        return free[:count], None
    for start in free:
        group = [start]
        for g in free:
            if g != start and all(g in peers.get(h, set()) or h in peers.get(g, set()) for h in group):
                group.append(g)
            if len(group) == count:
                return sorted(group), True
    return free[:count], False
