"""Place one replica of a model: try its profiles in order, every node judged, every refusal kept."""

from __future__ import annotations

from llmgw.placement.decisions import Decision
from llmgw.placement.fabric import place_across_fabric
from llmgw.placement.fit import NodeFit, fit_node, node_use
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import NodeSnap, ReplicaSnap, ShardPlacement, Snapshot


def place_one(model: Model, nodes: list[NodeSnap], snapshot: Snapshot,
              replicas: list[ReplicaSnap] | None = None) -> Decision:
    """A `place` decision for one replica of `model`, or a `refuse` with every candidate's reason.

    `nodes` carry their derived status. `replicas` (default: the snapshot's) are what already holds
    resources; the eviction planner passes a list without its would-be victims. The first profile that
    fits wins; a profile with `nodes` > 1 goes through the fabric planner. Refusal lines read
    `PROFILE on NODE: why` (or `PROFILE on fabric F: why`).
    """
    if not nodes:
        return Decision(kind="refuse", model=model.name, reason="no node has registered")
    profiles = {(m.name, p.name): p for m in snapshot.models for p in m.profiles}
    use = node_use(snapshot.replicas if replicas is None else replicas, profiles, {n.id: n for n in nodes})
    refusals: list[str] = []
    for profile in model.profiles:
        fits = [fit_node(profile, n, use.get(n.id)) for n in nodes]
        refusals += [f"{profile.name} on {f.node.id}: {f.reason}" for f in fits if not f.ok]
        ok = sorted((f for f in fits if f.ok), key=NodeFit.preference)
        if profile.shard_count == 1:
            if ok:
                best = ok[0]
                return Decision(kind="place", model=model.name, profile=profile.name, profile_spec=profile,
                                shards=[ShardPlacement(node_id=best.node.id, rank=0, gpus=best.gpus or [])],
                                reason=f"{best.node.id} {best.remark()}", refusals=refusals)
            continue
        fp = place_across_fabric(profile, ok)
        refusals += fp.refusals
        if fp.shards:
            return Decision(kind="place", model=model.name, profile=profile.name, profile_spec=profile,
                            shards=fp.shards, reason=fp.reason, refusals=refusals)
    return Decision(kind="refuse", model=model.name, reason="no node can take it", refusals=refusals)
