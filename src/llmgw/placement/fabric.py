"""Multi-node replicas: all shards on nodes of one InfiniBand fabric, each with an active adapter on it.

Why (seeds 001, "Stop trusting hardware facts"): shards on two fabrics, or on a node whose adapter has
no ACTIVE port, start, pass their health checks and hang on the first all-reduce. A node counts as on a
fabric only when its inventory lists that fabric with at least one adapter; the node worker advertises an
adapter only when it has an ACTIVE port, so this is the second of two checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.placement.fit import NodeFit
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import NodeSnap, ShardPlacement


def active_fabrics(node: NodeSnap) -> dict[str, float]:
    """Fabric name → link rate (Gb/s) for every fabric on which the node has an adapter listed."""
    return {f.name: f.rate_gbps for f in node.inventory.fabrics if f.adapters}


@dataclass
class FabricPlacement:
    """The result of `place_across_fabric`: shards (rank 0 first) or None, why, and turned-down lines."""

    shards: list[ShardPlacement] | None
    reason: str
    refusals: list[str]


def place_across_fabric(profile: Profile, fits: list[NodeFit]) -> FabricPlacement:
    """Choose `profile.nodes` nodes of one fabric for a multi-node replica.

    `fits` are the nodes that can take one shard each (`NodeFit.ok`). Nodes are chosen per fabric by
    `NodeFit.preference` (weights held, NVLink, load, id); fabrics are compared by how many chosen nodes
    hold the weights, how many have NVLink groups, the fabric's rate (its slowest active link), total load,
    then name. Rank 0 is the first chosen node. Every fabric and node turned down gets a line.
    """
    need = profile.nodes
    refusals: list[str] = []
    members: dict[str, list[NodeFit]] = {}
    rates: dict[str, float] = {}
    for f in fits:
        fabrics = active_fabrics(f.node)
        listed = [fb.name for fb in f.node.inventory.fabrics if not fb.adapters]
        if not fabrics:
            why = ("lists fabric " + ", ".join(listed) + " with no active adapter" if listed
                   else "is on no InfiniBand fabric with an active adapter")
            refusals.append(f"{profile.name} on {f.node.id}: {why}; a {need}-node replica needs one")
            continue
        for name, rate in fabrics.items():
            members.setdefault(name, []).append(f)
            rates[name] = min(rate, rates.get(name, rate))
    best: tuple | None = None
    for name in sorted(members):
        nodes = sorted(members[name], key=NodeFit.preference)
        if len(nodes) < need:
            refusals.append(f"{profile.name} on fabric {name}: {len(nodes)} node(s) can take a shard "
                            f"({', '.join(n.node.id for n in nodes)}), {need} needed")
            continue
        chosen = nodes[:need]
        score = (-sum(n.holds_weights for n in chosen), sum(n.nvlink is False for n in chosen), -rates[name],
                 sum(n.load for n in chosen), name)
        if best is None or score < best[0]:
            best = (score, name, chosen)
    if best is None:
        if not members:
            return FabricPlacement(None, "no node that can take a shard is on an InfiniBand fabric", refusals)
        return FabricPlacement(None, f"no fabric has {need} nodes that can each take a shard", refusals)
    _, name, chosen = best
    shards = [ShardPlacement(node_id=n.node.id, rank=rank, gpus=n.gpus or []) for rank, n in enumerate(chosen)]
    held = sum(n.holds_weights for n in chosen)
    why = f"{need} nodes on fabric {name}" + (f", {held} holding the weights" if held else "")
    return FabricPlacement(shards, why, refusals)
