"""How many replicas a model wants now: its bounds, its use, and its load (issue 13). Pure.

The rule, for a model with `scaling: {min, max, target_in_flight, scale_down_delay, idle_timeout}` and load
summed over the live gateways (`ModelState`: in flight + queued now, and the peak over the model's
scale_down_delay window):

- **floor**: `min`; an on-demand model (`min 0`) has a floor of 1 while it is asked for or was used within
  `idle_timeout`, else 0 (seeds 003, "Load a model when someone asks for it"). Once its last start has
  failed and nothing of it is placed, only a request since that failure counts (`waits_for_request`): the
  demand that led to the failed start is spent, and a broken model nobody is waiting for is not retried
  backoff after backoff;
- **up**: `ceil(load / target)`: one more replica as soon as the load now exceeds what the replicas
  placed (Ready or starting) carry at `target` each. Starting replicas count as capacity, so a burst
  during a cold start does not place a replica per request;
- **down** (hysteresis): only to `ceil(peak / (target × DOWN_AT))`, i.e. the replicas left would carry the
  window's peak at no more than DOWN_AT of their target; and never sooner than `scale_down_delay` after the
  newest replica was placed, so a scale-up is not undone by the next quiet second. Scale-down is always a
  drain (the planner's `stop` decision);
- the result is clamped to `[min, max]`.

Every result comes with its arithmetic, for `llmgw ctl explain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from llmgw.schemas.catalog import Model
from llmgw.schemas.payloads import ModelState

DOWN_AT = 0.8  # scale down only when the replicas left would be at most this loaded at the window's peak


@dataclass(frozen=True)
class Want:
    """How many replicas, why (one line with the numbers), and whether a scale-down is being held back."""

    count: int
    reason: str
    holding_down: bool = False


def waits_for_request(failed_at: datetime | None, demand_at: datetime | None, used_at: datetime | None) -> bool:
    """An on-demand model whose latest failed start (`failed_at`) is newer than every request for it
    (`demand_at`) and every use (`used_at`): nothing asked for it since it failed, so it waits for a request."""
    if failed_at is None:
        return False
    return all(t is None or t <= failed_at for t in (demand_at, used_at))


def _floor(model: Model, st: ModelState, now: datetime, placed: int) -> tuple[int, str]:
    sc = model.effective_scaling
    if sc.min > 0:
        return sc.min, f"min {sc.min}"
    if st.load > 0:
        return 1, f"on demand, {st.load} request(s) in flight or waiting"
    # Only with nothing placed: a Ready replica beside one that failed (a scale-up, a surge) keeps its
    # idle_timeout, because demand is recorded only while none is Ready.
    if placed == 0 and waits_for_request(st.failed_at, st.demand_at, st.last_used_at):
        ago = (now - st.failed_at).total_seconds() if st.failed_at else 0.0
        return 0, f"on demand, its last start failed {ago:.0f}s ago and nothing has asked for it since"
    last = max([t for t in (st.demand_at, st.last_used_at) if t is not None], default=None)
    if last is None:
        return 0, "on demand, not asked for"
    if placed == 0 and st.idle_stopped_at is not None and st.idle_stopped_at >= last:
        # Stopped for want of requests after its last use: a larger idle_timeout since does not start it.
        return 0, (f"on demand, stopped {(now - st.idle_stopped_at).total_seconds():.0f}s ago for want of "
                   "requests and not asked for since")
    idle = (now - last).total_seconds()
    if idle < sc.idle_timeout:
        return 1, f"on demand, used {idle:.0f}s ago (idle_timeout {sc.idle_timeout:g}s)"
    return 0, f"on demand, idle for {idle:.0f}s (idle_timeout {sc.idle_timeout:g}s)"


def wanted(model: Model, state: ModelState | None, now: datetime, placed: int,
           newest_age_s: float | None = None) -> Want:
    """Replicas `model` should have now. `placed` counts its starting and Ready replicas; `newest_age_s`
    is the age of the newest of them (None when there is none)."""
    sc = model.effective_scaling
    if sc.off:
        return Want(0, "scaling is off (max 0)" if model.scaling else "no scaling stanza: off")
    st = state or ModelState(name=model.name)
    floor, why = _floor(model, st, now, placed)
    target = model.target_in_flight
    if st.load == 0 and (st.peak == 0 or floor == 0):
        # An on-demand model idle past idle_timeout goes to zero whatever the peak window remembers. Above
        # a floor of 1 or more, the newest replica's scale-down delay still holds: no load and no peak is
        # also what a gateway's load row that stopped counting (a stall, a restart) looks like.
        if floor and placed > floor and newest_age_s is not None and newest_age_s < sc.scale_down_delay:
            return Want(placed, (f"{why}; no load reported: would scale down to {floor}, but the newest replica "
                                 f"is {newest_age_s:.0f}s old (scale_down_delay {sc.scale_down_delay:g}s)"),
                        holding_down=True)
        return Want(min(floor, sc.max), why)
    load_line = (f"load {st.load} ({st.in_flight} in flight, {st.queued} queued), peak {st.peak} over "
                 f"{sc.scale_down_delay:g}s, target {target} per replica")
    up = math.ceil(st.load / target)
    if up > placed:
        want = min(sc.max, max(floor, up))
        cap = f", capped at max {sc.max}" if up > sc.max else ""
        return Want(want, f"{why}; {load_line}: ceil({st.load}/{target}) = {up}{cap}")
    down = math.ceil(max(st.peak, st.load) / (target * DOWN_AT))
    keep = max(floor, sc.min, min(placed, down))
    if keep < placed:
        if newest_age_s is not None and newest_age_s < sc.scale_down_delay:
            return Want(placed, (f"{why}; {load_line}: would scale down to {keep}, but the newest replica is "
                                 f"{newest_age_s:.0f}s old (scale_down_delay {sc.scale_down_delay:g}s)"),
                        holding_down=True)
        return Want(min(sc.max, keep),
                    f"{why}; {load_line}: peak fits ceil({max(st.peak, st.load)}/({target}×{DOWN_AT:g})) = {down}")
    return Want(min(sc.max, max(floor, placed)), f"{why}; {load_line}: {placed} carry it")
