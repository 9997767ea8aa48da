"""One reconcile pass as a pure function: `plan_pass(snapshot) -> Plan`.

Rules (seeds 003, "Phase 3 (2/3): catalog and reconciler" and "Load a model when someone asks for it";
docs/architecture.md, "How a replica starts"):
- keep `min` replicas of every model; on demand (`min 0, max > 0`) keep one while it is asked for and
  stop it after `idle_timeout` without use, never with a request in flight; between `min` and `max`, scale
  on the load the gateways report (`placement.scale`: up at once, down by drain after `scale_down_delay`);
- replicas whose model or profile left the catalog are stopped;
- a node is Unreachable, then much later Lost, only when both witnesses (heartbeats, pollers) are silent;
  an Unreachable node keeps its replicas (a blip must not tear down a serving replica), a Lost node's
  replicas are lost and rebuilt; a blind observer declares nothing Lost, and teardown is rate-limited
  (`placement.liveness`);
- a replica starting for longer than its start budget is failed (`placement.deadline`);
- an ended replica not yet settled (a shard failed, a node came back without it) has every shard stopped;
- models are considered by priority, highest first; every replica a model lacks is placed in the same pass
  (up to `max_placements`), each accounted in the pass's view of the fleet (`placement.view`) before the
  next is chosen, because placement depends on what is already allocated;
- a model in failure backoff is held, and says so; so is one with a failed replica not yet settled (its
  failure, which sets the backoff, is counted when it is settled);
- a model that cannot be placed may evict lower-priority replicas (`placement.preempt`), for one model per
  pass; the room that frees (or that replicas already draining free) is reserved for it in the view;
- a model whose replicas run an older profile is replaced one replica at a time (`placement.rollout`): the
  planner places the surge replica, the `RolloutWorkflow` retires old ones;
- an on-demand model with `sleep_after` idle that long has its Ready replicas put to sleep, within each
  node's host memory for sleepers; wanted again, its sleepers are woken before anything is placed; a
  sleeper's room is given at once to a model that finds none otherwise (the sleeper stopped), before any
  live replica is evicted; past `idle_timeout` sleepers are stopped (`placement.sleep`);
- every model gets a line, so `llmgw ctl explain` always describes the latest pass.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from llmgw.placement.deadline import overdue_start
from llmgw.placement.decisions import Decision, Plan
from llmgw.placement.liveness import FleetLiveness, TeardownBudget, fleet_liveness, held_decision
from llmgw.placement.prestage import stages
from llmgw.placement.place import Probe, place_one
from llmgw.placement.preempt import fits_after_drains, plan_eviction
from llmgw.placement.rollout import is_outdated, next_step, plan_rules
from llmgw.placement.scale import wanted
from llmgw.placement.sleep import SleepRoom, evict_sleepers, sleep_due
from llmgw.placement.view import FleetView
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap, RolloutStep, Snapshot
from llmgw.schemas.status import ReplicaStatus

__all__ = ["backoff_delay", "desired_replicas", "place_one", "plan_pass"]


def desired_replicas(model: Model, state: ModelState | None, now: datetime, serving: int,
                     newest_age_s: float | None = None) -> tuple[int, str]:
    """How many replicas `model` should have now, and why (placement/scale.py has the rule). `serving`
    counts its starting and Ready ones; `newest_age_s` is the newest one's age (scale-down delay)."""
    w = wanted(model, state, now, serving, newest_age_s)
    return w.count, w.reason


def _where(r: ReplicaSnap) -> str:
    if len(r.shards) == 1:
        return r.shards[0].node_id
    return ", ".join(sorted({s.node_id for s in r.shards})) or "no node"


def _ended_and_orphans(snapshot: Snapshot, plan: Plan, catalog: dict[str, Model],
                       fleet: FleetLiveness) -> list[ReplicaSnap]:
    """Decide lost, orphaned, overdue and unsettled replicas; return the live ones (active, model still wanted)."""
    live: list[ReplicaSnap] = []
    budget = TeardownBudget.of(snapshot)
    status = plan.node_status
    wanted = {(m.name, p.name) for m in catalog.values() for p in m.profiles}
    unreadable = set(snapshot.unreadable_models) - set(catalog)
    holding = ReplicaStatus.holding()
    # Nodes neither lost nor held back from being lost: a replica on these alone needs neither decision
    # (the common case, asked 15k times a pass at 10k nodes: issue 42).
    calm = {nid for nid, seen in fleet.nodes.items() if seen.held is None and status.get(nid, "lost") != "lost"}
    for r in snapshot.replicas:
        if r.status not in holding:
            if not r.settled:
                plan.decisions.append(Decision(
                    kind="cleanup", model=r.model, replica_id=r.id, drain=False, final_status=r.status,
                    reason=f"it is {r.status} and not every shard is known to have stopped ({_where(r)})"))
            continue
        if all(s.node_id in calm for s in r.shards):
            lost_nodes, held = [], None
        else:
            lost_nodes = sorted({s.node_id for s in r.shards if status.get(s.node_id, "lost") == "lost"})
            held = held_decision(r, fleet, budget, lost_nodes)
        overdue = overdue_start(r, catalog.get(r.model), snapshot)
        if held is not None:
            plan.decisions.append(held)
            live.append(r)
        elif lost_nodes:
            plan.decisions.append(Decision(kind="lost", model=r.model, replica_id=r.id, drain=False, final_status=ReplicaStatus.LOST,
                                           reason=f"node {', '.join(lost_nodes)} is lost"))
        elif overdue is not None:
            plan.decisions.append(overdue)
        elif r.model in unreadable:
            plan.decisions.append(Decision(kind="keep", model=r.model, replica_id=r.id, reason=(
                "its stored catalog entry cannot be read by this version (`ctl models` says why): kept running, "
                "not routed, until a catalog that names the model again, or leaves it out, is applied")))
        elif (r.model, r.profile) not in wanted and not (r.model in catalog and catalog[r.model].profiles):
            # (a profile that left a model which still has profiles is rolled: placement/rollout.py)
            what = "model" if r.model not in catalog else "model's profiles"
            plan.decisions.append(Decision(kind="stop", model=r.model, replica_id=r.id,
                                           drain=r.status != ReplicaStatus.SLEEPING,
                                           reason=f"its {what} left the catalog"))
        else:
            live.append(r)
    return live


def _with_status(snapshot: Snapshot, plan: Plan | None = None, fleet: FleetLiveness | None = None) -> list[NodeSnap]:
    """The snapshot's nodes with their status now, as both liveness witnesses say (`placement.liveness`),
    recorded in `plan.node_status` when given."""
    fleet = fleet or fleet_liveness(snapshot)
    nodes: list[NodeSnap] = []
    for n in snapshot.nodes:
        status = fleet.status(n.id)
        if plan is not None:
            plan.node_status[n.id] = status
        nodes.append(n if n.status == status else n.model_copy(update={"status": status}))
    return nodes


def rollout_step(snapshot: Snapshot, name: str) -> RolloutStep:
    """The next step of `name`'s rolling replacement (placement/rollout.py), from one snapshot."""
    model = next((m for m in snapshot.models if m.name == name), None)
    mine = [r for r in snapshot.replicas if r.model == name and r.status in ReplicaStatus.live()]
    if model is None:
        return next_step(None, mine, 0, False, None)
    st = next((s for s in snapshot.model_states if s.name == name), None)
    # Without the scale-down hold: the surge replica is the newest, and holding for it would surge again.
    want, _ = desired_replicas(model, st, snapshot.now, len(mine), None)
    want = min(want, model.effective_scaling.max)
    backoff = None
    if st and st.backoff_until and st.backoff_until > snapshot.now:
        backoff = (f"backing off {(st.backoff_until - snapshot.now).total_seconds():.0f}s after "
                   f"{st.failures} failed start(s)")
    nodes = _with_status(snapshot)
    ready_nodes = {n.id for n in nodes if n.status == "ready"}
    unrouted = frozenset(r.id for r in mine if not all(s.node_id in ready_nodes for s in r.shards))
    room = place_one(model, FleetView(nodes, snapshot.replicas, snapshot.models)).kind == "place"
    fits_after = None
    if not room:
        old = sorted((r for r in mine if is_outdated(r, model)),
                     key=lambda r: (r.status != ReplicaStatus.STARTING, r.created_at.timestamp() if r.created_at else 0))
        if old:  # would the new profile fit where the replica retired first was?
            d = place_one(model, FleetView(nodes, [r for r in snapshot.replicas if r.id != old[0].id], snapshot.models))
            fits_after = None if d.kind == "place" else (d.reason or "no node fits it")
    return next_step(model, mine, want, room, backoff, fits_after, unrouted)


MAX_PLACEMENTS = 64  # per pass: each costs the workflow a record_placement and a child start (history events)


def plan_pass(snapshot: Snapshot, max_placements: int = MAX_PLACEMENTS, fleet: FleetLiveness | None = None) -> Plan:
    """Decide one pass. Pure: the same snapshot always gives the same plan.

    Up to `max_placements` replicas are placed, each accounted in the pass's `FleetView` before the next is
    chosen; room an eviction or a drain will free is reserved for the model it is for, so a later (lower
    priority) model in the same pass cannot take it. At most one eviction per pass: the view cannot tell
    which of two evictions' victims will have gone first. `fleet`: the snapshot's liveness when the caller
    has judged it already (`fleet_liveness(snapshot)`, the same).
    """
    now = snapshot.now
    plan = Plan()
    fleet = fleet or fleet_liveness(snapshot)
    nodes = _with_status(snapshot, plan, fleet)
    catalog = {m.name: m for m in snapshot.models}
    states = {s.name: s for s in snapshot.model_states}
    live = _ended_and_orphans(snapshot, plan, catalog, fleet)
    failed_unsettled = {r.model: r.id for r in snapshot.replicas if r.status == ReplicaStatus.FAILED and not r.settled}
    serving_by_model: dict[str, list[ReplicaSnap]] = {}
    for r in live:
        if r.status in ReplicaStatus.live():
            serving_by_model.setdefault(r.model, []).append(r)
    draining = [r for r in snapshot.replicas if r.status == ReplicaStatus.DRAINING]
    view: FleetView | None = None  # built when the first model needs a replica: a pass that only keeps needs none
    evicting: set[str] = set()
    placed = 0
    evicted = False
    # Sleeping replicas (placement/sleep.py): by model, and per node with the host memory each holds asleep.
    sleepers = [r for r in live if r.status == ReplicaStatus.SLEEPING]
    asleep_by_model: dict[str, list[ReplicaSnap]] = {}
    for r in sleepers:
        asleep_by_model.setdefault(r.model, []).append(r)
    profiles = {(m.name, p.name): p for m in snapshot.models for p in m.profiles}
    room = SleepRoom(sleepers, profiles, {n.id: n for n in nodes}, snapshot.sleep_host_memory_gb)
    ready_nodes = {nid for nid, st in plan.node_status.items() if st == "ready"}

    def stop_sleeper(r: ReplicaSnap, reason: str, kind: str = "stop", for_model: str | None = None,
                     to_zero: bool = False) -> None:
        """Stop sleeping replica `r` (nothing in flight: no drain); it leaves the pass's sleepers."""
        evicting.add(r.id)
        room.remove(r)
        plan.decisions.append(Decision(kind=kind, model=r.model, replica_id=r.id, drain=False, for_model=for_model,
                                       to_zero=to_zero, reason=reason))

    for model in sorted(snapshot.models, key=lambda m: (-m.priority, m.name)):
        if not model.profiles:
            plan.decisions.append(Decision(kind="keep", model=model.name, reason="routed to its static endpoints"))
            continue
        mine = [r for r in serving_by_model.get(model.name, ()) if r.id not in evicting]
        serving = len(mine)
        st = states.get(model.name)
        newest = max((r.created_at for r in mine if r.created_at is not None), default=None)
        want, why = desired_replicas(model, st, now, serving,
                                     (now - newest).total_seconds() if newest is not None else None)
        want = min(want, model.effective_scaling.max)
        if any(is_outdated(r, model) for r in mine):  # a rollout: its surge is no scale-up to hold for
            want, why = desired_replicas(model, st, now, serving, None)
            want = min(want, model.effective_scaling.max)
        asleep = [r for r in asleep_by_model.get(model.name, ()) if r.id not in evicting]
        for r in [r for r in asleep if is_outdated(r, model)]:
            stop_sleeper(r, "asleep, and its profile changed since it started: stopped rather than woken")
            asleep.remove(r)
        if want == 0:
            for r in asleep:
                stop_sleeper(r, f"asleep; 0 wanted ({why})", to_zero=True)
            asleep = []
        due = sleep_due(model, st, now) if want > 0 else None
        if due is not None:
            _sleep(model, mine, asleep, due, plan, room, catalog, states, ready_nodes, stop_sleeper, now)
            continue
        wakeable = sorted((r for r in asleep if all(s.node_id in ready_nodes for s in r.shards)),
                          key=lambda r: (-(r.created_at or now).timestamp(), r.id))
        if want > serving and wakeable:
            # The fastest rung: the engine is loaded and asleep (issue 39). Woken ones count as serving.
            for r in wakeable[: want - serving]:
                plan.decisions.append(Decision(kind="wake", model=model.name, replica_id=r.id, reason=(
                    f"{serving} of {want} wanted ({why}); rung: wake a sleeping replica, the fastest way back: its "
                    f"engine is loaded and asleep on {_where(r)}")))
                serving += 1
            if serving >= want:
                continue
        rolling, surge = plan_rules(model, mine, want, why)
        if rolling:
            plan.decisions.extend(rolling)
            if not surge:
                continue
            if model.name in failed_unsettled:  # as below: the surge waits until that failure is counted
                plan.decisions.append(Decision(kind="wait", model=model.name, reason=(
                    f"{rolling[0].reason}; replica {failed_unsettled[model.name][:8]} just failed: waiting until "
                    "its failure is counted against the backoff")))
                continue
            if st and st.backoff_until and st.backoff_until > now:
                plan.decisions.append(Decision(kind="wait", model=model.name, reason=(
                    f"{rolling[0].reason}; backing off {(st.backoff_until - now).total_seconds():.0f}s after "
                    f"{st.failures} failed start(s); the old replicas keep serving")))
                continue
            if placed >= max_placements:
                plan.more = True
                continue
            view = view or FleetView(nodes, snapshot.replicas, snapshot.models)
            d = _sleep_mode(model, place_one(model, view))
            d.reason = f"{rolling[0].reason}; surge: {d.reason}"
            plan.decisions.append(d)
            if d.kind == "place":
                placed += 1
                view.add(_holding(d, f"placed-{placed}"))
            continue
        if serving > want:
            if st and st.load > 0 and want == 0:
                plan.decisions.append(Decision(kind="keep", model=model.name,
                                               reason=f"{why}; not stopped with requests in flight"))
                continue
            # Stop the newest first: the oldest have warm caches and proven health.
            extra = sorted(mine, key=lambda r: (r.status != ReplicaStatus.STARTING, -(r.created_at or now).timestamp()))
            for r in extra[: serving - want]:
                plan.decisions.append(Decision(kind="stop", model=model.name, replica_id=r.id, to_zero=want == 0,
                                               reason=f"{serving} running, {want} wanted ({why})"))
            continue
        if serving == want:
            where = "; ".join(f"{r.id[:8]} {r.status} on {_where(r)}" for r in [*mine, *asleep])
            plan.decisions.append(Decision(kind="keep", model=model.name,
                                           reason=f"{serving} of {want} wanted ({why})" + (f": {where}" if where else "")))
            continue
        if model.name in failed_unsettled:
            # Its failure is counted (and the backoff set) when it is settled; a start placed before that
            # would slip past the backoff, once per failure.
            plan.decisions.append(Decision(kind="wait", model=model.name, reason=(
                f"{serving} of {want} wanted ({why}); replica {failed_unsettled[model.name][:8]} just failed: "
                "waiting until its failure is counted against the backoff")))
            continue
        if st and st.backoff_until and st.backoff_until > now:
            wait = (st.backoff_until - now).total_seconds()
            plan.decisions.append(Decision(kind="wait", model=model.name, reason=(
                f"{serving} of {want} wanted ({why}); backing off {wait:.0f}s after {st.failures} failed start(s)")))
            continue
        for have in range(serving, want):
            head = f"{have} of {want} wanted ({why})"
            if placed >= max_placements:
                plan.more = True
                rule = f"{max_placements} placements this pass, the most one pass makes"
                plan.decisions.append(Decision(kind="wait", model=model.name, reason=f"{head}; {rule}, next pass"))
                break
            view = view or FleetView(nodes, snapshot.replicas, snapshot.models)
            d = _sleep_mode(model, place_one(model, view))
            if d.kind == "place":
                d.reason = f"{head}; {d.reason}"
                plan.decisions.append(d)
                placed += 1
                view.add(_holding(d, f"placed-{placed}"))
                continue
            probe = Probe(model, view)
            # A sleeper's room is free for others (placement/sleep.py): taken at once, the sleeper stopped.
            took = evict_sleepers(model, view, [r for r in sleepers if r.id not in evicting], catalog, states, probe)
            if took is not None and took[1].kind == "place":
                victims, d = took
                for v in victims:
                    stop_sleeper(v, f"asleep ({_used(states, v.model, now)}): its room goes to {model.name} at once",
                                 kind="evict", for_model=model.name)
                view.release(victims)
                d = _sleep_mode(model, d)
                d.reason = (f"{head}; {d.reason}, in the room of sleeping replica(s) "
                            f"{', '.join(f'{v.id[:8]} of {v.model}' for v in victims)} (stopped)")
                plan.decisions.append(d)
                placed += 1
                view.add(_holding(d, f"placed-{placed}"))
                continue
            drains = fits_after_drains(model, view, draining, probe)
            if drains is not None:
                ids, after = drains
                view.add(_holding(after, f"reserved-{model.name}"))
                plan.decisions.append(Decision(kind="wait", model=model.name, refusals=d.refusals, reason=(
                    f"{head}; waiting for draining replica(s) {', '.join(i[:8] for i in ids)} to stop and free room")))
                break
            ev = None
            if not evicted:
                candidates = [r for r in live if r.id not in evicting]
                ev = plan_eviction(model, view, candidates, catalog, states, probe)
            if ev is None:
                if evicted and _could_evict(model, live, evicting, catalog):
                    plan.more = True
                    plan.decisions.append(Decision(kind="wait", model=model.name, refusals=d.refusals, reason=(
                        f"{head}; {d.reason}; it may evict lower-priority replicas, one eviction per pass, next pass")))
                else:
                    d.reason = f"{head}; {d.reason}"
                    plan.decisions.append(d)
                break
            evicted = True
            view.add(_holding(ev.placement, f"reserved-{model.name}"))
            names = []
            for v in ev.victims:
                evicting.add(v.id)
                vm = catalog[v.model]
                used = states.get(v.model).last_used_at if states.get(v.model) else None
                ago = f"last used {(now - used).total_seconds():.0f}s ago" if used else "never used"
                names.append(f"{v.id[:8]} of {v.model} on {_where(v)}")
                plan.decisions.append(Decision(
                    kind="evict", model=v.model, replica_id=v.id, for_model=model.name,
                    reason=f"evicted for {model.name} (priority {model.priority} > {vm.priority}); {ago}"))
            plan.decisions.append(Decision(kind="wait", model=model.name, refusals=d.refusals, reason=(
                f"{head}; evicting {len(ev.victims)} lower-priority replica(s) to make room: {'; '.join(names)}; "
                f"placed once they have drained ({ev.placement.reason})")))
            break
    if snapshot.prestage_recent_s:
        acted = {d.model for d in plan.decisions if d.kind != "keep"}
        plan.decisions.extend(stages(snapshot, lambda: view or FleetView(nodes, snapshot.replicas, snapshot.models),
                                     acted, states, now))
    return plan


def _used(states: dict[str, ModelState], name: str, now: datetime) -> str:
    st = states.get(name)
    used = max([t for t in ((st.last_used_at, st.demand_at) if st else ()) if t is not None], default=None)
    return f"last used {(now - used).total_seconds():.0f}s ago" if used else "never used"


def _sleep_mode(model: Model, d: Decision) -> Decision:
    """A placement of a model with `sleep_after`, whose engine can sleep, is launched able to."""
    if d.kind == "place" and model.effective_scaling.sleep_after is not None and d.profile_spec is not None \
            and d.profile_spec.sleep_refusal() is None:
        d.sleep_mode = True
    return d


def _sleep(model: Model, mine: list[ReplicaSnap], asleep: list[ReplicaSnap], due: str, plan: Plan, room: SleepRoom,
           catalog: dict[str, Model], states: dict[str, ModelState], ready_nodes: set[str], stop_sleeper,
           now: datetime) -> None:
    """`model` should be asleep (`due` says why): put its Ready replicas to sleep where their engines can
    and their nodes have host memory for sleepers (evicting lower sleepers for it); keep the rest. Nothing
    is placed for a model that should be asleep."""
    kept: list[str] = []
    for r in mine:
        profile = model.profile(r.profile)
        if is_outdated(r, model):
            plan.decisions.append(Decision(kind="stop", model=model.name, replica_id=r.id, reason=(
                f"{due}; its profile changed since it started: stopped rather than put to sleep")))
            continue
        if r.status != ReplicaStatus.READY:
            kept.append(f"{r.id[:8]} {r.status} (sleeps once ready)")
            continue
        refusal = profile.sleep_refusal() if profile is not None else "its profile left the catalog"
        if refusal is None and not all(s.node_id in ready_nodes for s in r.shards):
            refusal = f"its node {_where(r)} is not ready"
        victims: list[ReplicaSnap] = []
        if refusal is None:
            victims, refusal = room.make_room(r, catalog, states)
        if refusal is not None:
            kept.append(f"{r.id[:8]} stays awake on {_where(r)}: {refusal}")
            continue
        for v in victims:
            stop_sleeper(v, f"asleep ({_used(states, v.model, now)}): its host memory for sleepers "
                            f"goes to replica {r.id[:8]} of {model.name}", kind="evict", for_model=model.name)
        room.add(r)
        plan.decisions.append(Decision(kind="sleep", model=model.name, replica_id=r.id, reason=(
            f"{due}; its engine keeps its process and frees its accelerator memory on {_where(r)}, holding "
            f"{room.cost_mb(r) / 1024:.1f} GB of host memory asleep")))
    kept += [f"{r.id[:8]} asleep on {_where(r)}" for r in asleep]
    if kept or not any(d.model == model.name for d in plan.decisions):
        plan.decisions.append(Decision(kind="keep", model=model.name, reason=(
            f"{due}: " + ("; ".join(kept) if kept else "nothing runs; the next request starts it"))))


def _holding(d: Decision, rid: str) -> ReplicaSnap:
    """A decided placement as something that holds its shards' resources in the pass's view."""
    return ReplicaSnap(id=rid, model=d.model, profile=d.profile or "default", status=ReplicaStatus.STARTING, shards=d.shards)


def _could_evict(model: Model, live: list[ReplicaSnap], evicting: set[str], catalog: dict[str, Model]) -> bool:
    return any(r.id not in evicting and r.model in catalog and catalog[r.model].priority < model.priority
               and r.status in ReplicaStatus.live() for r in live)


def backoff_delay(failures: int, rand: float, base_s: float = 5.0, cap_s: float = 600.0) -> timedelta:
    """Jittered exponential backoff after `failures` failed starts: base·2^(n-1), ±50 %, never above `cap_s`.

    `rand` is a uniform [0, 1) draw. Jitter keeps a fleet of failing models from retrying in lockstep.
    Carried on the model, not the replica, because the replica that failed is destroyed (seeds 003).
    """
    raw = min(cap_s, base_s * (2 ** max(0, min(failures, 32) - 1)))
    return timedelta(seconds=min(cap_s, raw * (0.5 + rand)))
