"""Pre-staging (issue 39, the activation ladder's fourth item): the weights of an on-demand model used
lately, and not running now, are fetched ahead onto the node its next start would take, so that start
finds them on disk (rung "start from the weights already in its cache") instead of fetching while a client
waits.

Pure, like the rest of the planner: which node is the one `place_one` would choose on this pass's view
(every placement of the pass already in it); nothing is staged where the weights already are, for a model
with a replica in any state but ended, or with a multi-node profile (each rank's node would need them; not
yet), and only while `Snapshot.prestage_recent_s` has not passed since its last use. A node's budget,
`Snapshot.prestage_disk_gb`, bounds the weights it holds for catalog models that run nowhere on it (the
profiles' `disk_gb`): staged, or left by replicas that stopped. Room on the disk itself is the placement's
own check (`fit.py`: a node without room for the weights is no candidate). At most `MAX_STAGES` a pass.

The decision (`stage`) is carried out by `decide` itself, which starts a `StageWeightsWorkflow` for it
(workflows/stage.py): the reconciler's workflow never sees it, so runs from before replay unchanged.
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable

from llmgw.placement.decisions import Decision
from llmgw.placement.place import fetched, place_one
from llmgw.placement.view import FleetView
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, ShardPlacement, Snapshot
from llmgw.weights.naming import cache_name_for

MAX_STAGES = 4  # stages one pass starts: each is a download, and they compete with starts for the network
MAX_TRIES = 16  # models one pass judges for it (each a `place_one` over every node)


def staged_gb(snapshot: Snapshot) -> dict[str, float]:
    """Per node, the GB of weights on its disk for catalog models with no live replica there (`disk_gb`)."""
    sizes: dict[str, float] = {}
    for m in snapshot.models:
        for p in m.profiles:
            if p.disk_gb and fetched(p):
                name = cache_name_for(p.source)  # type: ignore[arg-type]
                sizes[name] = max(sizes.get(name, 0.0), p.disk_gb)
    running: dict[str, set[str]] = {}
    by_model = {m.name: m for m in snapshot.models}
    for r in snapshot.replicas:
        if r.status.is_ended or r.model not in by_model:
            continue
        for p in by_model[r.model].profiles:
            if p.name == r.profile and fetched(p):
                for s in r.shards:
                    running.setdefault(s.node_id, set()).add(cache_name_for(p.source))  # type: ignore[arg-type]
    return {n.id: sum(sizes.get(c, 0.0) for c in n.inventory.cached_sources if c not in running.get(n.id, ()))
            for n in snapshot.nodes}


def stages(snapshot: Snapshot, view_of: Callable[[], FleetView], acted: set[str], states: dict[str, ModelState],
           now: datetime) -> list[Decision]:
    """`stage` decisions for this pass (see the module). `view_of()`: the pass's view, with its placements;
    `acted`: models this pass already decided to change."""
    recent = snapshot.prestage_recent_s
    if not recent:
        return []
    candidates: list[tuple[float, Model]] = []
    for m in snapshot.models:
        st = states.get(m.name)
        used = st.last_used_at if st else None
        if m.effective_scaling.min > 0 or m.name in acted or used is None:
            continue
        ago = (now - used).total_seconds()
        if ago <= recent:
            candidates.append((ago, m))
    if not candidates:  # no on-demand model used lately: nothing more to read of the fleet
        return []
    live = {r.model for r in snapshot.replicas if not r.status.is_ended}  # sleeping included
    candidates = [c for c in candidates if c[1].name not in live]
    budget = snapshot.prestage_disk_gb if snapshot.prestage_disk_gb is not None else float("inf")
    held: dict[str, float] | None = None  # read once a stage is in view
    out: list[Decision] = []
    view = view_of() if candidates else None
    for ago, m in sorted(candidates, key=lambda c: (-c[1].priority, c[0], c[1].name))[:MAX_TRIES]:
        d = place_one(m, view, explain=False)  # type: ignore[arg-type]
        if d.kind != "place" or len(d.shards) != 1 or d.profile_spec is None or not fetched(d.profile_spec):
            continue
        node = view.by_id.get(d.shards[0].node_id)  # type: ignore[union-attr]
        name = cache_name_for(d.profile_spec.source)  # type: ignore[arg-type]
        if node is None or name in node.inventory.cached_sources:
            continue  # its next start already takes the weights from that node's disk
        gb = d.profile_spec.disk_gb or 0.0
        held = staged_gb(snapshot) if held is None else held
        if held.get(node.id, 0.0) + gb > budget:
            continue
        held[node.id] = held.get(node.id, 0.0) + gb
        out.append(Decision(
            kind="stage", model=m.name, profile=d.profile, profile_spec=d.profile_spec,
            shards=[ShardPlacement(node_id=node.id)],
            reason=(f"last used {ago:.0f}s ago and not running: its weights are fetched ahead onto {node.id}, where "
                    f"its next start would go, so that start fetches nothing ({held[node.id]:.0f} of "
                    f"{'no bound' if budget == float('inf') else f'{budget:.0f}'} GB staged there)")))
        if len(out) >= MAX_STAGES:
            break
    return out
