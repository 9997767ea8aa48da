"""One reconcile pass as a pure function: `plan_pass(snapshot) -> Plan`.

Rules (seeds 003, "Phase 3 (2/3): catalog and reconciler"; DESIGN.md "Workflows"):
- keep `min` replicas of every model; on demand (`min 0, max > 0`) keep one while it is asked for and
  stop it after `idle_timeout` without use, never with a request in flight;
- never more than `max`; replicas whose model or profile left the catalog are stopped;
- replicas on a Lost node are lost (and rebuilt by a later placement); Unreachable nodes keep theirs;
- at most one placement per pass, because placement depends on what is already allocated;
- a model in failure backoff is held, and says so.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from llmgw.placement.decisions import Decision, Plan
from llmgw.placement.fit import NodeUse, fit_single_node, node_use
from llmgw.placement.status import node_status
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, NodeSnap, ShardPlacement, Snapshot
from llmgw.weights.naming import cache_name_for

HOLDING = ("starting", "ready", "draining")


def desired_replicas(model: Model, state: ModelState | None, now: datetime, serving: int) -> tuple[int, str]:
    """How many replicas `model` should have now, and why."""
    sc = model.effective_scaling
    if sc.off:
        return 0, "scaling is off (max 0)" if model.scaling else "no scaling stanza: off"
    if sc.min > 0:
        return sc.min, f"min {sc.min}"
    # On demand: wanted while asked for, until idle_timeout has passed since the last use.
    st = state or ModelState(name=model.name)
    if st.in_flight > 0:
        return max(1, serving), f"{st.in_flight} request(s) in flight"
    last = max([t for t in (st.demand_at, st.last_used_at) if t is not None], default=None)
    if last is None:
        return 0, "on demand, not asked for"
    idle = (now - last).total_seconds()
    if idle < sc.idle_timeout:
        return max(1, min(serving, sc.max)), f"on demand, used {idle:.0f}s ago (idle_timeout {sc.idle_timeout:g}s)"
    return 0, f"on demand, idle for {idle:.0f}s (idle_timeout {sc.idle_timeout:g}s)"


def place_one(model: Model, nodes: list[NodeSnap], snapshot: Snapshot) -> Decision:
    """Find a node for one replica of `model`, trying profiles in order. Every refusal carries a reason."""
    profiles = {(m.name, p.name): p for m in snapshot.models for p in m.profiles}
    use = node_use(snapshot.replicas, profiles)
    refusals: list[str] = []
    if not nodes:
        return Decision(kind="refuse", model=model.name, reason="no node has registered", refusals=[])
    for profile in model.profiles:
        candidates: list[tuple[tuple, NodeSnap, list[int]]] = []
        for node in nodes:
            if profile.nodes > 1:
                refusals.append(f"{profile.name} on {node.id}: multi-node profiles are placed by the fabric planner (not available)")
                continue
            gpus, why = fit_single_node(profile, node, use.get(node.id, NodeUse()))
            if gpus is None:
                refusals.append(f"{profile.name} on {node.id}: {why}")
                continue
            holds = bool(profile.source) and cache_name_for(profile.source) in node.inventory.cached_sources
            load = sum(1 for r in snapshot.replicas if r.status in HOLDING for s in r.shards if s.node_id == node.id)
            # Prefer nodes that hold the weights, then the least loaded, then by id for determinism.
            candidates.append(((0 if holds else 1, load, node.id), node, gpus))
        if candidates:
            candidates.sort(key=lambda c: c[0])
            _, node, gpus = candidates[0]
            why = "holds the weights" if candidates[0][0][0] == 0 else "least loaded"
            return Decision(
                kind="place", model=model.name, profile=profile.name, profile_spec=profile,
                shards=[ShardPlacement(node_id=node.id, rank=0, gpus=gpus)], reason=why, refusals=refusals,
            )
    return Decision(kind="refuse", model=model.name, reason="no node can take it", refusals=refusals)


def plan_pass(snapshot: Snapshot) -> Plan:
    """Decide one pass. Pure: the same snapshot always gives the same plan."""
    now = snapshot.now
    plan = Plan()
    nodes: list[NodeSnap] = []
    for n in snapshot.nodes:
        status = node_status(n.last_heartbeat, now, snapshot.unreachable_after_s, snapshot.lost_after_s)
        plan.node_status[n.id] = status
        nodes.append(n.model_copy(update={"status": status}))
    catalog = {m.name: m for m in snapshot.models}
    states = {s.name: s for s in snapshot.model_states}

    # Replicas whose node is lost, or whose model/profile left the catalog.
    live = []
    for r in snapshot.replicas:
        if r.status not in HOLDING:
            continue
        lost_nodes = [s.node_id for s in r.shards if plan.node_status.get(s.node_id, "lost") == "lost"]
        model = catalog.get(r.model)
        if lost_nodes:
            plan.decisions.append(Decision(kind="lost", model=r.model, replica_id=r.id,
                                           reason=f"node {', '.join(sorted(set(lost_nodes)))} is lost"))
        elif model is None or model.profile(r.profile) is None:
            what = "model" if model is None else f"profile {r.profile!r}"
            plan.decisions.append(Decision(kind="stop", model=r.model, replica_id=r.id,
                                           reason=f"its {what} left the catalog"))
        else:
            live.append(r)

    placed = False
    for model in sorted(snapshot.models, key=lambda m: (-m.priority, m.name)):
        if not model.profiles:
            continue  # routed to static endpoints only
        mine = [r for r in live if r.model == model.name and r.status in ("starting", "ready")]
        serving = len(mine)
        want, why = desired_replicas(model, states.get(model.name), now, serving)
        want = min(want, model.effective_scaling.max)
        if serving > want:
            st = states.get(model.name)
            if st and st.in_flight > 0 and want == 0:
                continue  # never stop a model with a request in flight
            # Stop the newest first: the oldest have warm caches and proven health.
            extra = sorted(mine, key=lambda r: (r.status != "starting", -(r.created_at or now).timestamp()))
            for r in extra[: serving - want]:
                plan.decisions.append(Decision(kind="stop", model=model.name, replica_id=r.id,
                                               reason=f"{serving} running, {want} wanted ({why})"))
        elif serving < want:
            st = states.get(model.name)
            if st and st.backoff_until and st.backoff_until > now:
                wait = (st.backoff_until - now).total_seconds()
                plan.decisions.append(Decision(kind="wait", model=model.name,
                                               reason=f"backing off {wait:.0f}s after {st.failures} failed start(s)"))
                continue
            if placed:
                plan.more = True
                plan.decisions.append(Decision(kind="wait", model=model.name,
                                               reason=f"{serving} of {want} wanted; one placement per pass"))
                continue
            d = place_one(model, nodes, snapshot)
            d.reason = f"{serving} of {want} wanted ({why}); {d.reason}"
            plan.decisions.append(d)
            if d.kind == "place":
                placed = True
                if serving + 1 < want:
                    plan.more = True
    return plan


def backoff_delay(failures: int, rand: float, base_s: float = 5.0, cap_s: float = 600.0) -> timedelta:
    """Jittered exponential backoff after `failures` failed starts: base·2^(n-1), ±50 %, capped.

    `rand` is a uniform [0, 1) draw (from `workflow.random()` in workflows, for determinism).
    """
    raw = min(cap_s, base_s * (2 ** max(0, failures - 1)))
    return timedelta(seconds=raw * (0.5 + rand))
