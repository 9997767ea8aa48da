"""The pass's own view of the fleet: what every node holds, kept up to date while the pass decides.

Why (docs/architecture.md, "How a replica starts"): two placements chosen from one snapshot could be handed
the same GPUs. The view is built once per pass from the snapshot's replicas; each placement the pass makes
is added to it before the next one is chosen, so a pass can place many replicas and never hand out a card
twice. The eviction search takes would-be victims out of it and puts them back, touching only their nodes:
one trial costs the victim's shards, not the fleet (issue 10, "Scale").
"""

from __future__ import annotations

from llmgw.placement.fit import NodeFit, NodeUse, cache_name, fit_node, node_use
from llmgw.schemas.catalog import Model, Profile
from llmgw.schemas.payloads import NodeSnap, ReplicaSnap
from llmgw.schemas.status import ReplicaStatus


def holds_resources(r: ReplicaSnap) -> bool:
    """Active replicas hold what they were given; so do ended ones until settled (their shards may run)."""
    return r.status in ReplicaStatus.holding() or not r.settled


class FleetView:
    """Nodes (status already derived) and, per node, the `NodeUse` of the replicas that hold resources there.

    `use[node_id]` is always the sum over the node's holders that are not released; `add` adds a holder
    (a placement this pass made, or room reserved for one), `release`/`restore` take holders out and put them
    back (eviction and drain trials). Each returns the node ids whose use changed.

    `fit(profile, node)` is `fit_node` remembered until the node's use changes, for profiles that ask the
    same of a node (placing many replicas re-judges only the node the last one went to).
    """

    def __init__(self, nodes: list[NodeSnap], replicas: list[ReplicaSnap], models: list[Model]):
        self.nodes = nodes
        self.by_id = {n.id: n for n in nodes}
        self.profiles: dict[tuple[str, str], Profile] = {(m.name, p.name): p for m in models for p in m.profiles}
        self._holders: dict[str, list[ReplicaSnap]] = {}
        self._released: set[str] = set()
        for r in replicas:
            if holds_resources(r):
                for s in r.shards:
                    held = self._holders.get(s.node_id)
                    if held is None:
                        self._holders[s.node_id] = [r]
                    elif held[-1] is not r:  # two shards of one replica on one node count it once
                        held.append(r)
        self.use: dict[str, NodeUse] = node_use(replicas, self.profiles, self.by_id)
        self._version: dict[str, int] = {}
        self._fits: dict[tuple, tuple[int, NodeFit]] = {}

    def fit(self, profile: Profile, node: NodeSnap, asks: tuple | None = None) -> NodeFit:
        """`fit_node(profile, node, its use)`. `asks` is `fit_key(profile)`, when the caller has it."""
        asks = asks or fit_key(profile)
        weights = asks[-1]  # profiles that differ only in their weights ask the same of a node that holds neither
        holds = weights is not None and weights in node.inventory.cached_sources
        key = (node.id, asks[:-1], holds)
        version = self._version.get(node.id, 0)
        hit = self._fits.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        f = fit_node(profile, node, self.use.get(node.id), holds)
        self._fits[key] = (version, f)
        return f

    def _recount(self, node_ids: set[str]) -> set[str]:
        for nid in node_ids:
            self._version[nid] = self._version.get(nid, 0) + 1
            held = [r for r in self._holders.get(nid, ()) if r.id not in self._released]
            self.use[nid] = node_use(held, self.profiles, self.by_id).get(nid, NodeUse())
        return node_ids

    def add(self, holder: ReplicaSnap) -> set[str]:
        """Count `holder` (status `starting` for a placement: its weights count against disk) as holding."""
        touched = {s.node_id for s in holder.shards}
        for nid in touched:
            self._holders.setdefault(nid, []).append(holder)
        return self._recount(touched)

    def release(self, replicas: list[ReplicaSnap]) -> set[str]:
        """Take `replicas` out (as if they had stopped)."""
        self._released.update(r.id for r in replicas)
        return self._recount({s.node_id for r in replicas for s in r.shards})

    def restore(self, replicas: list[ReplicaSnap]) -> set[str]:
        """Put released `replicas` back."""
        self._released.difference_update(r.id for r in replicas)
        return self._recount({s.node_id for r in replicas for s in r.shards})


def fit_key(profile: Profile) -> tuple:
    """What `fit_node` reads from a profile, apart from whether the node holds its weights; last, the cache
    name of its weights (or None), which tells that."""
    return (profile.name, profile.engine, profile.disk_gb, profile.memory_gb, profile.gpus_per_shard,
            profile.gpu_memory_gb, cache_name(profile.source) if profile.source else None)
