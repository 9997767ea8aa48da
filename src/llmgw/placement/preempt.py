"""Eviction and preemption: make room for a higher-priority model by draining lower-priority replicas.

Rules (docs/architecture.md, "How a replica starts"; issue 3): only replicas of models with a strictly lower `priority` are
candidates, lowest priority first and, within a priority, the model used least recently (never used
counts as oldest); a replica already draining is not a candidate, it is already leaving. A replica is
evicted only when its going makes the placement possible: victims are added in that order until the
model fits, then any victim the placement turns out not to need is spared again (most recently used
first). Evicted replicas drain before they stop; the model is placed by a later pass, once they are gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from llmgw.placement.decisions import Decision
from llmgw.placement.place import Probe, place_one
from llmgw.placement.view import FleetView
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState, ReplicaSnap
from llmgw.schemas.status import ReplicaStatus

_NEVER = datetime.min.replace(tzinfo=timezone.utc)


@dataclass
class Eviction:
    """Victims to drain and stop (in the order chosen) and the placement they make possible."""

    victims: list[ReplicaSnap]
    placement: Decision


def eviction_order(model: Model, live: list[ReplicaSnap], catalog: dict[str, Model],
                   states: dict[str, ModelState]) -> list[ReplicaSnap]:
    """Candidates for eviction in the order they go: lowest priority, least recently used, newest replica."""
    def key(r: ReplicaSnap) -> tuple:
        st = states.get(r.model)
        used = (st.last_used_at if st else None) or _NEVER
        created = r.created_at.timestamp() if r.created_at else 0.0
        return (catalog[r.model].priority, used, -created, r.id)

    return sorted((r for r in live if r.status in ReplicaStatus.live() and r.model in catalog
                   and catalog[r.model].priority < model.priority), key=key)


def plan_eviction(model: Model, view: FleetView, live: list[ReplicaSnap], catalog: dict[str, Model],
                  states: dict[str, ModelState], probe: Probe | None = None) -> Eviction | None:
    """The fewest lower-priority replicas, in `eviction_order`, whose going lets `model` be placed; None
    when evicting every candidate would not be enough (then nothing is evicted).

    Each trial takes one victim out of `view` (or puts one back) and re-judges only its nodes (`Probe`);
    the placement itself is chosen once, with the final victims out. `view` is left as it was given.
    """
    found = fewest_victims(model, view, eviction_order(model, live, catalog, states), probe, explain=False)
    return Eviction(*found) if found is not None else None


def fewest_victims(model: Model, view: FleetView, order: list[ReplicaSnap], probe: Probe | None = None,
                   explain: bool = True) -> tuple[list[ReplicaSnap], Decision] | None:
    """The fewest replicas of `order`, taken in that order, whose going lets `model` be placed, and that
    placement; None when all of them would not be enough. Each trial takes one victim out of `view` (or puts
    one back, sparing those the placement turns out not to need) and re-judges only its nodes (`Probe`); the
    placement is chosen once, with the final victims out. `view` is left as it was given."""
    if not order:
        return None
    probe = probe or Probe(model, view)
    victims: list[ReplicaSnap] = []
    try:
        for r in order:
            victims.append(r)
            probe.update(view.release([r]))
            if probe.fits():
                break
        else:
            return None
        for r in reversed(list(victims)):
            probe.update(view.restore([r]))
            if probe.fits():
                victims.remove(r)
            else:
                probe.update(view.release([r]))
        return victims, place_one(model, view, explain=explain)
    finally:
        probe.update(view.restore(victims))


def fits_after_drains(model: Model, view: FleetView, draining: list[ReplicaSnap],
                      probe: Probe | None = None) -> tuple[list[str], Decision] | None:
    """When `model` fits once the replicas now draining have stopped: (their ids, that placement)."""
    if not draining:
        return None
    probe = probe or Probe(model, view)
    try:
        probe.update(view.release(draining))
        if not probe.fits():
            return None
        return [r.id for r in draining], place_one(model, view)
    finally:
        probe.update(view.restore(draining))
