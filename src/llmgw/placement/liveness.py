"""Is a node alive? Two witnesses, a blind observer, and a rate limit on tearing down (issue 9).

The rules, and where they come from:
- **Two witnesses.** A node is silent only when both its node-API heartbeats and its worker's pollers on
  `node/<id>` (Temporal's task-queue description) are silent. The two paths are independent (node API vs
  Temporal), so one of them failing (a frozen gateway, an expired node-API certificate, Postgres down)
  cannot make a healthy node look dead. Seeds 003: Unreachable, then much later Lost, because rebuilding a
  multi-node replica costs tens of minutes.
- **A witness that cannot see is not a witness.** Heartbeats count as silent only from when the node API
  was last continuously receiving them (`observer_age_s`: its processes tick into Postgres; none ticking =
  blind). Pollers likewise, from when the control worker was last continuously reading them
  (`pollers_age_s`; after a Postgres or control-worker outage the recorded times are stale, not the
  nodes). An idle poller's last access is when its long poll began, so it may age by Temporal's long-poll
  interval (`poller_grace_s`) without meaning anything. A witness that cannot see says nothing, and a node
  is never declared silent on one witness alone.
- **The pollers are read in rotation** (issue 42: one RPC per node per pass does not fit a pass at 10k
  nodes): each pass reads a bounded slice, oldest read first (control/liveness.py), and a node's poller
  silence counts only up to its last read (`poll_read_age_s` is taken off): what was not looked at is
  not silence. So a dead node's pollers show silent at most one rotation late, never a live one early.
- **A blind observer evicts nothing** (Kubernetes' node lifecycle controller): when more than
  `silent_share` of the nodes that matter are silent together, the observer is the likelier fault: no node
  is declared Lost, and once the doubt ends every node gets `lost_after_s` afresh (`doubted_at`), as
  Kubernetes resets its timers when a zone leaves full disruption: nodes come back one by one, and the
  last must not be lost for being last. Nodes that count: every node that answers, every silent one that holds a replica, and
  every empty silent one that went silent no more than `lost_after_s` before the longest-silent node that
  holds one (an empty node gone for days says nothing about today's silence).
- **A goodbye is believed.** A node whose agent said it was leaving (`left_at`, the agent stopping its
  engines on exit) is Unreachable at once rather than after the witnesses' silence (the pollers' grace
  alone is a minute): nothing is placed on it until it registers again. Lost still needs the silence.
- **Teardown is rate-limited**: at most `lost_teardown_limit` replicas of lost nodes per
  `lost_teardown_window_s`; the rest wait for a later pass, and say so.

Everything here is pure: facts in, statuses and reasons out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from llmgw.placement.decisions import Decision
from llmgw.placement.status import node_status
from llmgw.schemas.payloads import LivenessFacts, ReplicaSnap, Snapshot
from llmgw.schemas.status import ReplicaStatus


@dataclass
class NodeLiveness:
    """One node's status and the evidence. `heartbeat_silent_s`/`poller_silent_s` are None when that
    witness could not see (node API blind, pollers unreadable); `math.inf` when it never saw the node.
    `held` says why a node that would be Lost is not."""

    status: str  # ready | unreachable | lost
    heartbeat_silent_s: float | None = None
    poller_silent_s: float | None = None
    held: str | None = None
    left_s: float | None = None  # seconds since its agent said it was leaving (None: it did not)

    def describe(self) -> str:
        def one(name: str, s: float | None, blind: str) -> str:
            if s is None:
                return f"{name} {blind}"
            if math.isinf(s):
                return f"{name} never seen"
            # Within a couple of heartbeat intervals (2 s) is how a healthy node reads: "silent 1s" looked ill.
            return f"{name} silent {s:.0f}s" if s >= FRESH_S else f"{name} fresh"
        text = ", ".join([one("heartbeats", self.heartbeat_silent_s, "not observable"),
                          one("pollers", self.poller_silent_s, "not readable")])
        if self.left_s is not None:
            text = f"its agent left {self.left_s:.0f}s ago (stopping its engines); " + text
        return text + (f"; {self.held}" if self.held else "")


FRESH_S = 5.0  # a witness heard from this recently is described as fresh (what it decides is unchanged)


def witness_status(heartbeat_age_s: float | None, poll_age_s: float | None, observer_age_s: float | None,
                   pollers_age_s: float | None, unreachable_after_s: float, lost_after_s: float,
                   poller_grace_s: float, poll_read_age_s: float | None = None) -> NodeLiveness:
    """One node from its two witnesses (ages in seconds, by one clock).

    - `heartbeat_age_s`: since its last node-API heartbeat (None: never);
    - `poll_age_s`: since its worker last began a poll on `node/<id>` (None: never seen polling);
    - `poll_read_age_s`: since the control worker last read those pollers (the rotation); the poller
      silence is counted up to that read only. None: read this pass (a snapshot recorded before the
      rotation, or a node never read, whose `poll_age_s` is None anyway);
    - `observer_age_s`: since the node API began receiving continuously (None: it is not receiving now);
    - `pollers_age_s`: since the control worker began reading the pollers continuously (None: it is not
      reading them now, or they could not be read).
    """
    hb = None if observer_age_s is None else min(math.inf if heartbeat_age_s is None else heartbeat_age_s,
                                                 observer_age_s)
    unread = poll_read_age_s or 0.0
    poll = None if pollers_age_s is None else min(
        math.inf if poll_age_s is None else max(0.0, poll_age_s - unread - poller_grace_s), pollers_age_s)
    silent = 0.0 if hb is None or poll is None else min(hb, poll)
    status = "lost" if silent >= lost_after_s else "unreachable" if silent >= unreachable_after_s else "ready"
    return NodeLiveness(status, hb, poll)


def pollers_seen(poll_age_s: float | None, poll_read_age_s: float | None, poller_grace_s: float) -> str:
    """A node's pollers as the witness last saw them, for `ctl nodes` and the fleet page (POLLERS).

    An idle worker's last access is when its long poll began, so its age alone reads tens of seconds for a
    healthy node ("POLLED 48s ago" looked ill). What the witness knows is the read: at `poll_read_age_s` ago
    the last poll had begun at most `poller_grace_s` before, i.e. the worker was polling then ("polling, read
    3s ago"); or it had not ("silent 4m, read 3s ago": silent since its last poll, counted to now).
    """
    if poll_age_s is None:
        return "never seen"
    if poll_read_age_s is None:  # not yet read by the rotation (recorded before it): the age is all there is
        return f"last poll {_span(poll_age_s)} ago"
    read = f"read {_span(poll_read_age_s)} ago"
    if poll_age_s - poll_read_age_s <= poller_grace_s:
        return f"polling, {read}"
    return f"silent {_span(poll_age_s)}, {read}"


def _span(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def _age(now: datetime, t: datetime | None) -> float | None:
    return None if t is None else max(0.0, (now - t).total_seconds())


@dataclass
class FleetLiveness:
    """Every node's liveness this pass, and `blind`: why no node is declared Lost (None when they may be)."""

    nodes: dict[str, NodeLiveness] = field(default_factory=dict)
    blind: str | None = None
    notes: list[str] = field(default_factory=list)

    def status(self, node_id: str) -> str:
        n = self.nodes.get(node_id)
        return n.status if n else "lost"


def fleet_liveness(snapshot: Snapshot) -> FleetLiveness:
    """Node statuses for one pass. A snapshot without `liveness` facts (recorded before issue 9) is judged
    by heartbeats alone, exactly as it was then, so its workflow history replays unchanged."""
    now = snapshot.now
    facts = snapshot.liveness
    out = FleetLiveness()
    if facts is None:
        for n in snapshot.nodes:
            out.nodes[n.id] = NodeLiveness(node_status(n.last_heartbeat, now, snapshot.unreachable_after_s,
                                                       snapshot.lost_after_s), _age(now, n.last_heartbeat))
        return out
    observer_age = _age(now, facts.observer_since)
    pollers_age = _age(now, facts.pollers_since) if facts.pollers_error is None else None
    doubt_age = _age(now, facts.doubted_at)
    if observer_age is None:
        out.notes.append("the node API is not receiving heartbeats (no node-API process has ticked in "
                         f"{snapshot.unreachable_after_s:g}s): heartbeats say nothing until it does")
    if facts.pollers_error:
        out.notes.append(f"the pollers on node queues could not be read ({facts.pollers_error}): "
                         "no node is judged silent without them")
    for n in snapshot.nodes:
        seen = out.nodes[n.id] = witness_status(_age(now, n.last_heartbeat), _age(now, n.polled_at), observer_age,
                                                pollers_age, snapshot.unreachable_after_s,
                                                snapshot.lost_after_s, facts.poller_grace_s,
                                                _age(now, n.poll_read_at))
        if n.left_at is not None:
            # Its agent said goodbye (and stopped its engines): nothing goes there until it registers again.
            # Lost still takes both witnesses' silence, as for any node.
            seen.left_s = _age(now, n.left_at)
            if seen.status == "ready":
                seen.status = "unreachable"
    holding = {s.node_id for r in snapshot.replicas if r.status in ReplicaStatus.holding() for s in r.shards}
    out.blind = blind_observer(out.nodes, holding, snapshot.lost_after_s, facts)
    if out.blind:
        held = "not declared lost: " + out.blind
    elif doubt_age is not None and doubt_age < snapshot.lost_after_s:
        held = (f"not declared lost: the observer was in doubt {doubt_age:.0f}s ago, and a node is lost only "
                f"after {snapshot.lost_after_s:g}s of silence since then")
    else:
        return out
    for n in out.nodes.values():
        if n.status == "lost":
            n.status, n.held = "unreachable", held
    return out


def blind_observer(nodes: dict[str, NodeLiveness], holding: set[str], lost_after_s: float,
                   facts: LivenessFacts) -> str | None:
    """Why the observer should be doubted this pass (too many nodes silent together), or None."""
    def silent_for(n: NodeLiveness) -> float:
        return min(n.heartbeat_silent_s or 0.0, n.poller_silent_s or 0.0)

    judged = [silent_for(n) for i, n in nodes.items() if n.status != "ready" and i in holding]
    if not judged:
        return None  # no replica hangs on the verdict
    horizon = max(judged) + lost_after_s
    matter = {i: n for i, n in nodes.items()
              if n.status == "ready" or i in holding or silent_for(n) <= horizon}
    silent = sorted(i for i, n in matter.items() if n.status != "ready")
    if len(silent) / len(matter) <= facts.silent_share:
        return None
    return (f"{len(silent)} of {len(matter)} nodes are silent together ({', '.join(silent)}), more than "
            f"{facts.silent_share:.0%}: the observer is the likelier fault")


@dataclass
class TeardownBudget:
    """How many replicas of lost nodes this pass may still tear down (`lost_teardown_limit` per window)."""

    left: int
    limit: int
    window_s: float
    recent: int

    @classmethod
    def of(cls, snapshot: Snapshot) -> "TeardownBudget":
        f = snapshot.liveness
        if f is None:
            return cls(left=1 << 30, limit=1 << 30, window_s=0, recent=0)
        return cls(left=max(0, f.lost_teardown_limit - f.recent_lost), limit=f.lost_teardown_limit,
                   window_s=f.lost_teardown_window_s, recent=f.recent_lost)

    def take(self) -> str | None:
        """Spend one teardown; None when allowed, else why not."""
        if self.left > 0:
            self.left -= 1
            return None
        return (f"teardown of replicas on lost nodes is rate-limited to {self.limit} per {self.window_s:g}s "
                f"({self.recent} in the window before this pass): it waits for a later pass")


def held_decision(r: ReplicaSnap, fleet: FleetLiveness, budget: TeardownBudget, lost_nodes: list[str]) -> Decision | None:
    """Why replica `r`, on a silent node, is not torn down this pass (a `keep` that `ctl explain` shows),
    or None when nothing holds it back. Spends `budget` when `r` is on a lost node and may go."""
    held = sorted({s.node_id for s in r.shards if (n := fleet.nodes.get(s.node_id)) is not None and n.held})
    if held:
        return Decision(kind="keep", model=r.model, replica_id=r.id, reason=(
            f"replica {r.id[:8]} is on silent node {', '.join(held)} ({fleet.nodes[held[0]].describe()}): "
            "nothing is torn down"))
    if lost_nodes:
        why = budget.take()
        if why is not None:
            return Decision(kind="keep", model=r.model, replica_id=r.id,
                            reason=f"replica {r.id[:8]} is on lost node {', '.join(lost_nodes)}, but {why}")
    return None
