"""A model's status as an operator and a client should see it, derived from observed facts by one pure
function (`model_condition`). `llmgw ctl models`, `ctl replicas`, the gateway's 503 answers, `/v1/models`
and the chat page all read it, so they never disagree.

The statuses, in the order they are decided:

- `static`: routed to endpoints the catalog names; llmgw runs nothing for it;
- `ready`: at least one replica serves;
- `loading`: a replica is starting now (and none serves yet): the only status that says "loading";
- `off`: `scaling.max` is 0;
- `sleeping`: its replicas are asleep (`scaling.sleep_after`): engines loaded, accelerator memory released;
  a request wakes one (held by the gateway meanwhile, as for a load);
- `failing`: its last start(s) failed and nothing serves: like Kubernetes' CrashLoopBackOff, with the
  count of consecutive failed starts (`restarts`), the last failure's cause, and the backoff remaining
  before the reconciler tries again (`retry_in_s`; `llmgw ctl retry MODEL` clears it). An on-demand model
  nothing has asked for since it failed is not tried again until a request asks (`on_request`);
- `unplaceable`: the latest reconcile pass found no node that can take it (`ctl explain` says why);
- `stopping`: only draining replicas are left;
- `on demand`: `min 0`, nothing running: a request starts it;
- `pending`: wanted, not yet placed (the next reconcile pass places it).
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from llmgw.placement.scale import waits_for_request
from llmgw.schemas.catalog import Model
from llmgw.schemas.status import ReplicaStatus


class ModelStatus(StrEnum):
    STATIC = "static"
    READY = "ready"
    LOADING = "loading"
    OFF = "off"
    SLEEPING = "sleeping"
    FAILING = "failing"
    UNPLACEABLE = "unplaceable"
    STOPPING = "stopping"
    ON_DEMAND = "on demand"
    PENDING = "pending"


class ModelFacts(BaseModel):
    """What is known about one model now. `replicas`: its active replicas by status (`starting`, `ready`,
    `draining`); `failures`: consecutive failed starts (reset by a start that reaches Ready); `replaced`:
    its replicas that ended failed or lost, ever (never reset: `ctl models` RESTARTS);
    `last_failure`: the cause of its latest failed replica (one line); `refused`: why the latest reconcile
    pass could not place it, if it could not."""

    replicas: dict[ReplicaStatus, int] = Field(default_factory=dict)
    failures: int = 0
    replaced: int = 0
    backoff_until: datetime | None = None
    last_failure: str | None = None
    last_failure_at: datetime | None = None
    last_failed_replica: str | None = None
    refused: str | None = None
    failed_at: datetime | None = None  # when its latest failed start was counted
    demand_at: datetime | None = None  # the latest request for it while none was Ready
    last_used_at: datetime | None = None


class ModelCondition(BaseModel):
    """`status` with its `reason` (one line, empty when there is nothing to add), `restarts` (consecutive
    failed starts) and, while failing, `retry_in_s`: seconds until the reconciler may start it again
    (0 when the backoff has passed and a start is due). `on_request`: a failing on-demand model that nothing
    has asked for since it failed; its next start waits for a request (and for `retry_in_s`)."""

    status: ModelStatus
    reason: str = ""
    ready: int = 0
    starting: int = 0
    sleeping: int = 0
    restarts: int = 0
    retry_in_s: int | None = None
    last_failure: str | None = None
    on_request: bool = False


def model_condition(model: Model, facts: ModelFacts, now: datetime) -> ModelCondition:
    """The status of `model` from `facts`, at `now` (the database clock)."""
    ready = facts.replicas.get(ReplicaStatus.READY, 0)
    starting = facts.replicas.get(ReplicaStatus.STARTING, 0)
    sleeping = facts.replicas.get(ReplicaStatus.SLEEPING, 0)
    base = dict(ready=ready, starting=starting, sleeping=sleeping, restarts=facts.failures,
                last_failure=facts.last_failure)
    sc = model.effective_scaling
    if not model.profiles:
        n = len(model.endpoints)
        return ModelCondition(status=ModelStatus.STATIC, reason=f"routed to {n} static endpoint(s)", **base)
    if ready:
        if not facts.failures:
            return ModelCondition(status=ModelStatus.READY, **base)
        # Serving, while the starts of another replica (a rolling replacement, a scale-up) keep failing: said,
        # or a stuck rollout would look like nothing at all in `ctl models`.
        left = _backoff_left(facts, now)
        cause = facts.last_failure or "its last start failed"
        return ModelCondition(status=ModelStatus.READY, retry_in_s=left, **base, reason=(
            f"serving; {facts.failures} start(s) of another replica failed in a row, the last with: {cause}"
            + (f"; next try in {left}s" if left else "")))
    if starting:
        again = f" (after {facts.failures} failed start(s))" if facts.failures else ""
        return ModelCondition(status=ModelStatus.LOADING, reason=f"a replica is starting{again}", **base)
    if sc.off:
        return ModelCondition(status=ModelStatus.OFF, reason="switched off in the catalog (scaling max 0)", **base)
    if sleeping:
        return ModelCondition(status=ModelStatus.SLEEPING, reason=(
            f"{sleeping} replica(s) asleep (engine loaded, accelerator memory released); a request wakes one"), **base)
    if facts.failures:
        left = _backoff_left(facts, now)
        cause = facts.last_failure or "its last start failed"
        on_request = sc.min == 0 and waits_for_request(facts.failed_at, facts.demand_at, facts.last_used_at)
        return ModelCondition(status=ModelStatus.FAILING, reason=cause, retry_in_s=left, on_request=on_request,
                              **base)
    if facts.refused:
        return ModelCondition(status=ModelStatus.UNPLACEABLE, reason=facts.refused, **base)
    if facts.replicas.get(ReplicaStatus.DRAINING, 0):
        return ModelCondition(status=ModelStatus.STOPPING, reason="its replicas are draining", **base)
    if sc.on_demand:
        return ModelCondition(status=ModelStatus.ON_DEMAND, reason="starts when a request asks for it", **base)
    return ModelCondition(status=ModelStatus.PENDING, reason="waiting for the reconciler to place it", **base)


def _backoff_left(facts: ModelFacts, now: datetime) -> int:
    """Whole seconds until the backoff after failed starts ends (0: over, or none)."""
    if facts.backoff_until is None:
        return 0
    return max(0, math.ceil((facts.backoff_until - now).total_seconds()))


def failure_cause(failure: str | None, exit_reasons: list[tuple[int, str, str]] | None = None) -> str | None:
    """The one-line cause of a replica's failure: the decoded exit of its first shard that exited
    (`exit_reasons`: (rank, node, reason)), else the failure text's first line. None without a failure."""
    for rank, node, reason in sorted(exit_reasons or []):
        if reason:
            return f"{reason} (rank {rank} on {node})"
    if not failure or not failure.strip():
        return None
    return failure.strip().splitlines()[0][:300]


# The words of an engine's exit that say what happened (engines/exits.py `describe_exit`): `killed by SIGILL
# (illegal instruction)`, `exited with code 1`. What follows them in a cause is the line of the engine's own
# output that `with_output` picked (or our hint about the signal).
_EXIT_WORDS = re.compile(r"killed by SIG[A-Z0-9]+ \([^)]*\)|exited with code -?\d+")
OPERATOR_SEES = "an operator sees the whole cause in `llmgw ctl models` and `llmgw ctl replicas`"


def client_cause(cause: str | None) -> str:
    """A failure's cause as an API client (a tenant) may read it: its first line, and when that tells how an
    engine ended, only up to those words. The engine's output the operator's cause goes on to quote (a line
    `with_output` picked, the tail after `last output:`) may hold a logged prompt of another tenant (issue
    36). Causes of our own (a download that failed, a start that timed out) are kept; `for_client` then
    takes the fleet's addresses and paths out of them."""
    first = (cause or "").strip().split("\n", 1)[0].strip()
    if not first:
        return "its start failed"
    m = _EXIT_WORDS.search(first)
    return first[:m.end()] if m else first


def client_reason(cond: ModelCondition) -> str:
    """`cond.reason` as `/v1/models` and the gateway's 503s say it to a client: a failing model's cause
    cut to `client_cause` (the whole cause stays in the admin API's `reason` and `last_failure`)."""
    if cond.status == ModelStatus.FAILING:
        return f"{client_cause(cond.last_failure)} ({OPERATOR_SEES})"
    if cond.status == ModelStatus.READY and cond.restarts:
        return (f"serving; {cond.restarts} start(s) of another replica failed in a row, the last with: "
                f"{client_cause(cond.last_failure)}" + (f"; next try in {cond.retry_in_s}s" if cond.retry_in_s else ""))
    return cond.reason
