"""A `starting` replica has a deadline outside its workflow (issue 9).

A start workflow that is wedged, or was terminated, would otherwise hold its GPUs for ever: the planner
fails a replica that has been starting for longer than its profile's start budget (`start_timeout`, else
the control plane's `start_budget_s`), measured from placement. Download progress deliberately does not
reset it (seeds 001: an hour-long download would keep a doomed replica alive indefinitely), so the budget
must cover fetching the weights as well as loading them.
"""

from __future__ import annotations

from llmgw.placement.decisions import Decision
from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ReplicaSnap, Snapshot
from llmgw.schemas.status import ReplicaStatus


def start_budget_s(model: Model | None, profile: str, default_s: float) -> float:
    """The profile's `start_timeout` when it sets one, else `default_s` (seconds)."""
    p = model.profile(profile) if model else None
    return p.start_timeout if p is not None and p.start_timeout is not None else default_s


def overdue_start(r: ReplicaSnap, model: Model | None, snapshot: Snapshot) -> Decision | None:
    """A decision to fail `r` when it has been starting longer than its budget, else None."""
    if r.status != ReplicaStatus.STARTING or r.created_at is None:
        return None
    budget = start_budget_s(model, r.profile, snapshot.start_budget_s)
    age = (snapshot.now - r.created_at).total_seconds()
    if age <= budget:
        return None
    return Decision(kind="stop", model=r.model, replica_id=r.id, drain=False, final_status=ReplicaStatus.FAILED,
                    reason=f"starting for {age:.0f}s, longer than its start budget of {budget:g}s "
                           "(profile start_timeout, else start_budget_s): failed, its start cancelled")
