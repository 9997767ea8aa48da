"""Every `workflow.patched` id in llmgw's workflow code: which workflow asks it, the version that added it,
and when it may be retired. `tests/test_patches.py` fails if the code asks an id this registry lacks, or
the registry holds one the code no longer asks.

Retiring a patch takes two releases (docs/architecture.md, "Changing workflow code"):
1. **deprecate**: delete the old branch and turn `workflow.patched(id)` into `workflow.deprecate_patch(id)`,
   once no run that took the old branch can still be open (it would replay the old commands against new
   code); the histories that recorded the old branch go with it (`tests/histories/`);
2. **remove**: delete the `deprecate_patch` call, once no run recorded with the plain patch marker can
   still be open.

When a run can no longer be open depends on the workflow (`retire`):
- the reconciler continues as new within `MAX_PASSES` (100) passes, and an old run moves to the new branch
  at the first pass it runs live (its ids carry the pass number): a release that has run 100 passes ends
  every run that took the old branch. So each step may come one **release** after the one before;
- a replica start is bounded by the start budget (`start_budget_s`, an hour by default; the planner fails
  a start that runs longer), but a stop waits for its node until the node is lost, and a rollout for its
  replicas: a step may come one release after the one before **and** once `temporal workflow list --query
  'WorkflowType="<workflow>" AND ExecutionStatus="Running" AND StartTime < "<that release's deploy>"'`
  lists nothing.

A release is a minor version (`llmgw --version`): the compatibility rule (docs/operating.md, "Upgrading
llmgw") supports upgrading one minor version at a time, so no fleet skips a release's replay of a patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RECONCILER = "one release after `added_in` (continue-as-new within 100 passes)"
BOUNDED_RUNS = "one release after `added_in`, once no run started before that release's deploy is open"


@dataclass(frozen=True)
class Patch:
    """`id`: as passed to `workflow.patched` (`per_pass`: the id is `<id>/<pass number>`, a reconciler
    patch asked again at each pass until it is taken). `state`: `patched` (both branches in the code) or
    `deprecated` (only the new branch, asked with `workflow.deprecate_patch`)."""

    id: str
    workflow: str
    added_in: str
    retire: str
    why: str
    per_pass: bool = False
    state: Literal["patched", "deprecated"] = "patched"


# workflows/reconciler.py
DECIDE_IN_ACTIVITY = "decide-in-activity"
DECIDE_PLACES = "issue13-decide-places"
DECIDE_STARTS = "issue13-decide-starts"
# workflows/replica.py
FENCED_START = "issue9-fenced-start"
STOP_FENCES_START = "issue9-stop-fences-start"
QUICK_CHECKS = "issue13-quick-checks"
ONE_NODE_STEP = "issue13-one-node-step"
SETTLE_COUNTS = "settle-counts-failure"
DRAIN_OWNS = "drain-owns-the-engine"
FETCH_BY_TIME = "issue38-fetch-bounded-by-time"
# workflows/sleep.py
WAKE_LOCAL = "wake-local-steps"

PATCHES: dict[str, Patch] = {p.id: p for p in [
    # Deprecated in 0.2.0 (`_legacy_pass`, `one_per_pass` and the histories of runs that planned in workflow
    # code removed): runs of 0.1.0 asked it at pass 0. The call may go in 0.3.0.
    Patch(DECIDE_IN_ACTIVITY, "ReconcilerWorkflow", "0.1.0", RECONCILER, per_pass=True, state="deprecated",
          why="a pass plans in the `decide` activity, not in workflow code"),
    # Deprecated in 0.2.0 with it (the pass's `record_placements` branch and the histories of runs that
    # took it removed). The calls may go in 0.3.0.
    Patch(DECIDE_PLACES, "ReconcilerWorkflow", "0.1.0", RECONCILER, per_pass=True, state="deprecated",
          why="`decide` creates the replicas it places (no `record_placements` activity)"),
    Patch(DECIDE_STARTS, "ReconcilerWorkflow", "0.1.0", RECONCILER, per_pass=True, state="deprecated",
          why="`decide` starts the replicas it placed"),
    Patch(FENCED_START, "ReplicaStartWorkflow", "0.1.0", BOUNDED_RUNS,
          why="a start asks \"still wanted?\" and carries the fencing generation"),
    Patch(QUICK_CHECKS, "ReplicaStartWorkflow", "0.1.0", BOUNDED_RUNS,
          why="a start's \"still wanted?\" checks are local activities"),
    Patch(ONE_NODE_STEP, "ReplicaStartWorkflow", "0.1.0", BOUNDED_RUNS,
          why="a single-shard start fetches and launches in one node activity (`start_shard`)"),
    Patch(DRAIN_OWNS, "ReplicaStartWorkflow", "0.1.0", BOUNDED_RUNS,
          why="a start that finds its replica draining leaves the engine to the stop"),
    Patch(FETCH_BY_TIME, "ReplicaStartWorkflow", "0.2.0", BOUNDED_RUNS,
          why="a start's fetch (`fetch_weights`, `start_shard`) is retried while it makes progress, not 5 "
              "attempts (an agent restart ends an attempt)"),
    Patch(SETTLE_COUNTS, "ReplicaStartWorkflow, ReplicaStopWorkflow", "0.1.0", BOUNDED_RUNS,
          why="settling a failed replica counts its failure in the same transaction"),
    Patch(STOP_FENCES_START, "ReplicaStopWorkflow", "0.1.0", BOUNDED_RUNS,
          why="a stop marks the replica, cancels its start and waits for it, then stops with the new generation"),
    Patch(WAKE_LOCAL, "ReplicaWakeWorkflow", "0.2.0", BOUNDED_RUNS,
          why="a wake's control steps (its sleep closed?, its shards, marking it Ready) are local activities"),
]}
