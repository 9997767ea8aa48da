"""Sleeping replicas (issue 39): when an on-demand model's replicas sleep, when they wake, and how the room
they hold is given to others. Pure.

A sleeping replica's engine lives on (same process, weights kept in host memory) with its accelerator
memory released, so waking it answers in seconds where a start takes minutes. The rules, which
`placement/plan.py` applies:

- **sleep**: a model with `scaling.sleep_after` (on demand) that has had no request for `sleep_after`, and
  is not yet idle for `idle_timeout`, with no load: its Ready replicas go to sleep (`sleep_due`). An engine
  that cannot sleep (`Profile.sleep_refusal`: llama.cpp, vLLM and SGLang on the CPU) stays awake until
  `idle_timeout`, as before;
- **host memory**: asleep, a replica holds its offloaded weights in its node's host memory
  (`Profile.sleep_host_mb` per shard), within a per-node budget for sleepers (`Snapshot.sleep_host_memory_gb`,
  default half the node's host memory; `SleepRoom`). A replica that would pass it evicts sleepers of its
  priority or lower, least recently used first; when that is not enough it stays awake;
- **wake**: a model wanted awake again (a request, held by the gateway meanwhile) wakes its sleepers before
  anything is placed: the fastest rung there is;
- **GPUs**: the planner counts a sleeper's GPUs as free for others: a model that finds no room otherwise
  takes a sleeper's at once, in the same pass (`evict_sleepers`): the sleeper is stopped (nothing is in
  flight: no drain) and the placement made, before any live lower-priority replica would be evicted (which
  waits for the drain). Sleepers go in eviction order: lowest priority, least recently used, newest;
- **stop**: past `idle_timeout` (or the model off, removed, its profile changed), sleepers are stopped
  like any replica: fenced, no drain.
"""

from __future__ import annotations

from datetime import datetime, timezone

from llmgw.placement.place import Probe
from llmgw.placement.preempt import fewest_victims
from llmgw.placement.decisions import Decision
from llmgw.placement.view import FleetView
from llmgw.schemas.catalog import Model, Profile
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap
from llmgw.schemas.status import ReplicaStatus

_NEVER = datetime.min.replace(tzinfo=timezone.utc)


def sleep_due(model: Model, st: ModelState | None, now: datetime) -> str | None:
    """Why `model`'s replicas should be asleep now (None: they should not): `sleep_after` set, no load,
    and its last request or use at least `sleep_after` and less than `idle_timeout` ago."""
    sc = model.effective_scaling
    if sc.sleep_after is None or not sc.on_demand or st is None or st.load > 0:
        return None
    last = max([t for t in (st.demand_at, st.last_used_at) if t is not None], default=None)
    if last is None:
        return None
    idle = (now - last).total_seconds()
    if idle < sc.sleep_after or idle >= sc.idle_timeout:
        return None
    return f"on demand, idle for {idle:.0f}s (sleep_after {sc.sleep_after:g}s, idle_timeout {sc.idle_timeout:g}s)"


def budget_mb(node: NodeSnap | None, setting_gb: float | None) -> int:
    """Host memory `node` gives sleeping replicas: the setting, else half its host memory."""
    if setting_gb is not None:
        return int(setting_gb * 1024)
    return node.inventory.memory_mb // 2 if node is not None else 0


def sleeper_order(sleepers: list[ReplicaSnap], catalog: dict[str, Model],
                  states: dict[str, ModelState]) -> list[ReplicaSnap]:
    """Sleepers in the order they are evicted: lowest priority, least recently used, newest, id."""
    def key(r: ReplicaSnap) -> tuple:
        st = states.get(r.model)
        used = max([t for t in ((st.last_used_at, st.demand_at) if st else ()) if t is not None], default=_NEVER)
        m = catalog.get(r.model)
        return (m.priority if m else 0, used, -(r.created_at.timestamp() if r.created_at else 0.0), r.id)

    return sorted(sleepers, key=key)


def _gb(mb: int) -> str:
    return f"{mb / 1024:.1f} GB"


class SleepRoom:
    """Per node, the sleepers there and the host memory each holds asleep, kept current through a pass."""

    def __init__(self, sleepers: list[ReplicaSnap], profiles: dict[tuple[str, str], Profile],
                 nodes: dict[str, NodeSnap], setting_gb: float | None):
        self.profiles = profiles
        self.nodes = nodes
        self.setting_gb = setting_gb
        self.on: dict[str, list[ReplicaSnap]] = {}
        for r in sleepers:
            self.add(r)

    def cost_mb(self, r: ReplicaSnap) -> int:
        p = self.profiles.get((r.model, r.profile))
        return p.sleep_host_mb() if p is not None else 0

    def used_mb(self, node_id: str) -> int:
        return sum(self.cost_mb(r) for r in self.on.get(node_id, ()))

    def add(self, r: ReplicaSnap) -> None:
        for nid in {s.node_id for s in r.shards}:
            self.on.setdefault(nid, []).append(r)

    def remove(self, r: ReplicaSnap) -> None:
        for nid in {s.node_id for s in r.shards}:
            self.on[nid] = [x for x in self.on.get(nid, []) if x.id != r.id]

    def make_room(self, r: ReplicaSnap, catalog: dict[str, Model],
                  states: dict[str, ModelState]) -> tuple[list[ReplicaSnap], str | None]:
        """Sleepers to evict so that `r` may sleep on its nodes within their budgets, and why it may not
        (then the list is empty): a sleeper of a higher priority than `r`'s model is never evicted for it."""
        cost = self.cost_mb(r)
        mine = catalog.get(r.model)
        victims: dict[str, ReplicaSnap] = {}
        for nid in sorted({s.node_id for s in r.shards}):
            budget = budget_mb(self.nodes.get(nid), self.setting_gb)
            if cost > budget:
                return [], (f"it would hold {_gb(cost)} of host memory asleep on {nid}, more than the {_gb(budget)} "
                            "the node gives sleepers (sleep_host_memory_gb)")
            held = [x for x in self.on.get(nid, []) if x.id != r.id]
            used = sum(self.cost_mb(x) for x in held if x.id not in victims)
            for x in sleeper_order([x for x in held if x.id not in victims], catalog, states):
                if used + cost <= budget:
                    break
                xm = catalog.get(x.model)
                if mine is not None and xm is not None and xm.priority > mine.priority:
                    continue
                victims[x.id] = x
                used -= self.cost_mb(x)
            if used + cost > budget:
                return [], (f"{nid}'s {_gb(budget)} of host memory for sleepers is held by {_gb(used)} of "
                            "higher-priority sleepers")
        return list(victims.values()), None


def evict_sleepers(model: Model, view: FleetView, sleepers: list[ReplicaSnap], catalog: dict[str, Model],
                   states: dict[str, ModelState], probe: Probe | None = None) -> tuple[list[ReplicaSnap], Decision] | None:
    """The fewest sleepers of other models, in `sleeper_order`, whose room lets `model` be placed now, and
    that placement; None when every one of them would not be enough. `view` is left as it was given (the
    caller takes the victims out for good)."""
    order = sleeper_order([r for r in sleepers if r.model != model.name and r.status == ReplicaStatus.SLEEPING],
                          catalog, states)
    return fewest_victims(model, view, order, probe)
