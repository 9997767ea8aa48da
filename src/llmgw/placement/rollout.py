"""Rolling replacement when a model's profile changes (issue 13). Pure: snapshot in, decisions out.

A replica is *outdated* when the profile hash its node reports it runs (`ReplicaSnap.profile_hash`, from
the shard reports) differs from the catalog's profile of the same name, as launched (with the model's
adapters the node fetches, `Model.launch_profile`: a changed adapter is rolled out as a changed profile). A replica that has not reported
yet (hash None) is not outdated: it was placed from the current catalog, or predates hashes.

The work is split so that nothing races for GPUs:
- the reconciler's planner (`plan_rules`, called by `plan_pass`) keeps a `RolloutWorkflow` running for the
  model and places new replicas of the current profile: one at a time, up to `want + 1` (the surge), never
  by evicting anything; while outdated replicas remain it scales nothing down;
- the `RolloutWorkflow` retires old ones, one at a time, through `next_step`: when a new replica is Ready
  and the model has more replicas than it wants (the surge arrived), drain and stop the oldest outdated one;
  when no node has room for a surge, retire one first so the planner can place into the room it frees
  (fewer Ready replicas for a while: only when capacity leaves no other way), and only if the new profile
  fits in that room: one that fits no node leaves every old replica serving.
- `want` during a rollout is the model's want without the scale-down hold (placement/scale.py): the surge
  replica is the newest, and holding the count for it would make it the new want and surge again, up to
  `max`. A model wanted by no one (idle, off) is scaled down as any model is, not rolled.
- A replica whose profile left a model that still has profiles (renamed, replaced) is outdated: rolled one
  at a time like a changed one, not stopped with all the others at once.
So there are never fewer Ready replicas than before when capacity allows, and a new profile that fails to
start leaves the old replicas serving (the model backs off as after any failed start).
"""

from __future__ import annotations

from llmgw.placement.decisions import Decision
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ReplicaSnap, RolloutStep
from llmgw.schemas.status import ReplicaStatus


# Each catalog model's launched profile hashes, by the model object: a snapshot's catalog is the same object
# pass after pass while it is unchanged (db/catalog_repo.py CatalogMemo), and the hash (the profile as JSON,
# then sha256) cost ~15 us; asked for every replica, twice a pass, it was a third of the plan at 10k nodes
# (issue 42). The object is kept with its hashes, so an id is never taken for another's.
_LAUNCHED: dict[int, tuple[Model, dict[str, str]]] = {}
_LAUNCHED_MAX = 50_000


def launched_hashes(model: Model) -> dict[str, str]:
    """Profile name -> the `spec_hash()` a replica of it reports running (its launched form: adapters in)."""
    kept = _LAUNCHED.get(id(model))
    if kept is not None and kept[0] is model:
        return kept[1]
    if len(_LAUNCHED) >= _LAUNCHED_MAX:  # catalogs gone since: forgotten all at once
        _LAUNCHED.clear()
    out = {p.name: model.launch_profile(p).spec_hash() for p in model.profiles}
    _LAUNCHED[id(model)] = (model, out)
    return out


def is_outdated(r: ReplicaSnap, model: Model) -> bool:
    """Its profile changed, or left a model that still has profiles (renamed, replaced): rolled, not
    stopped at once with every other replica of it."""
    if r.profile_hash is None:
        return model.profile(r.profile) is None and bool(model.profiles)
    current = launched_hashes(model).get(r.profile)
    if current is None:
        return bool(model.profiles)
    return r.profile_hash != current


def hashes(model: Model) -> str:
    return ", ".join(f"{name}@{h[:8]}" for name, h in launched_hashes(model).items())


def plan_rules(model: Model, mine: list[ReplicaSnap], want: int, why: str) -> tuple[list[Decision], bool]:
    """The planner's part for a model with outdated replicas. Returns (decisions, place): `place` is True
    when the planner should place one replica of the current profile now (the surge), without eviction."""
    old = [r for r in mine if is_outdated(r, model)]
    if not old or want == 0:  # nothing wanted (idle, off): scaled down as any model is, not rolled
        return [], False
    new_starting = [r for r in mine if r not in old and r.status == ReplicaStatus.STARTING]
    head = (f"rolling replacement to {hashes(model)}: {len(old)} of {len(mine)} replica(s) run an older profile "
            f"({want} wanted: {why})")
    decisions = [Decision(kind="rollout", model=model.name, reason=head)]
    if new_starting:
        decisions.append(Decision(kind="keep", model=model.name,
                                  reason=f"{head}; replica {new_starting[0].id[:8]} of the new profile is starting"))
        return decisions, False
    if len(mine) >= want + 1:
        decisions.append(Decision(kind="keep", model=model.name,
                                  reason=f"{head}; the rollout drains an old replica next"))
        return decisions, False
    return decisions, True


def next_step(model: Model | None, replicas: list[ReplicaSnap], want: int, room: bool, backoff: str | None,
              fits_after: str | None = None, unrouted: frozenset[str] = frozenset()) -> RolloutStep:
    """What the `RolloutWorkflow` does next for `model`. `replicas` are the model's; `unrouted` the ids of
    those on a node that is not Ready (out of routing: not counted as serving, so a new replica there
    never lets an old one go); `want` is what the planner wants now; `room` whether a node can take one more replica; `backoff` the reason the model is
    held (failed starts) or None; `fits_after`, when there is no room, None if a replica of the new profile
    would fit once the oldest outdated replica is gone, else why it would not (then nothing is retired:
    a new profile that fits no node must not take the old replicas down one by one)."""
    if model is None:
        return RolloutStep(kind="done", reason="the model left the catalog; the reconciler stops its replicas")
    if want == 0:
        return RolloutStep(kind="done", reason="no replica is wanted now (idle or off); the reconciler stops them")
    live = [r for r in replicas if r.status in ReplicaStatus.live()]
    old = sorted((r for r in live if is_outdated(r, model)),
                 key=lambda r: (r.status != ReplicaStatus.STARTING, r.created_at.timestamp() if r.created_at else 0))
    new = [r for r in live if r not in old]
    counts = dict(outdated=len(old), current_ready=sum(1 for r in new if r.status == ReplicaStatus.READY))
    if not old:
        return RolloutStep(kind="done", reason=f"every replica runs {hashes(model)}", **counts)
    if any(r.status == ReplicaStatus.STARTING for r in new):
        return RolloutStep(kind="wait", reason="a replica of the new profile is starting", **counts)
    routed = sum(1 for r in live if r.id not in unrouted)
    if routed > want:
        v = old[0]
        return RolloutStep(kind="retire", replica_id=v.id, **counts,
                           reason=f"{routed} replicas routed, {want} wanted: retire {v.id[:8]} (older profile)")
    if backoff:
        return RolloutStep(kind="wait", reason=f"the new profile is held: {backoff}; the old replicas keep serving",
                           **counts)
    if not room:
        v = old[0]
        if fits_after is not None:
            return RolloutStep(kind="wait", **counts, reason=(
                f"the new profile does not fit even in the room {v.id[:8]} would free ({fits_after}); the old "
                "replicas keep serving: correct the profile, or add capacity"))
        return RolloutStep(kind="retire", replica_id=v.id, **counts,
                           reason=f"no node has room for a surge replica: retire {v.id[:8]} first, then place into its room")
    return RolloutStep(kind="wait", reason="waiting for the reconciler to place a replica of the new profile", **counts)
