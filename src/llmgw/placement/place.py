"""Place one replica of a model: try its profiles in order, every node judged, every refusal kept.

`Probe` answers only "would it fit?" while a search changes the view, re-judging just the nodes a change
touched; `place_one` then makes the decision, with every refusal, once the search knows the answer.
"""

from __future__ import annotations

from llmgw.placement.decisions import Decision
from llmgw.placement.fabric import active_fabrics, place_across_fabric
from llmgw.placement.fit import NodeFit
from llmgw.placement.view import FleetView, fit_key
from llmgw.schemas.catalog import Model, Profile
from llmgw.schemas.payloads import ShardPlacement
from llmgw.weights.naming import SourceError, parse_source


def place_one(model: Model, view: FleetView, explain: bool = True) -> Decision:
    """A `place` decision for one replica of `model`, or a `refuse` with every candidate's reason.

    `view` holds the nodes (status derived) and what already holds resources on each. The first profile
    that fits wins; a profile with `nodes` > 1 goes through the fabric planner. Refusal lines read
    `PROFILE on NODE: why` (or `PROFILE on fabric F: why`); with `explain` False the nodes' lines are left
    out (a placement the eviction search only wants the shards and reason of).
    """
    if not view.nodes:
        return Decision(kind="refuse", model=model.name, reason="no node has registered")
    refusals: list[str] = []
    for profile in model.profiles:
        asks = fit_key(profile)
        fits = [view.fit(profile, n, asks) for n in view.nodes]
        if explain:
            refusals += [f"{profile.name} on {f.node.id}: {f.reason}" for f in fits if not f.ok]
        ok = [f for f in fits if f.ok]
        if profile.shard_count == 1:
            if ok:
                best = min(ok, key=NodeFit.preference)
                return Decision(kind="place", model=model.name, profile=profile.name,
                                profile_spec=model.launch_profile(profile),
                                shards=[ShardPlacement(node_id=best.node.id, rank=0, gpus=best.gpus or [])],
                                reason=f"{best.node.id} {best.remark()}{rung(profile, best, fits)}", refusals=refusals)
            continue
        fp = place_across_fabric(profile, sorted(ok, key=NodeFit.preference))
        refusals += fp.refusals
        if fp.shards:
            return Decision(kind="place", model=model.name, profile=profile.name,
                            profile_spec=model.launch_profile(profile),
                            shards=fp.shards, reason=fp.reason, refusals=refusals)
    return Decision(kind="refuse", model=model.name, reason="no node can take it", refusals=refusals)


def fetched(profile: Profile) -> bool:
    """Whether a start of `profile` fetches weights into the node's cache (a `mirror:` or http(s) source)."""
    try:
        return parse_source(profile.source).kind == "remote"
    except SourceError:
        return False


def rung(profile: Profile, best: NodeFit, fits: list[NodeFit]) -> str:
    """Which rung of the activation ladder (issue 39) a start on `best` takes, and why, for the decision line:
    from the weights already in its cache (no fetch), else a fetch: from a peer that holds the weights but
    cannot take the replica (a single-node replica's start asks for them; node/peer_server.py), else from
    the mirror. Waking a sleeping replica, the first rung, is a decision of its own."""
    if not fetched(profile):
        return ""
    if best.holds_weights:
        return "; rung: start from the weights already in its cache (no fetch)"
    holders = sorted(f.node.id for f in fits if f.holds_weights)
    if not holders:
        return "; rung: fetch the weights from the mirror (no node holds them)"
    serving = [f.node.id for f in fits if f.holds_weights and f.node.inventory.peer_url and f.node.status == "ready"]
    verb = "holds" if len(holders) == 1 else "hold"
    if serving and profile.nodes == 1:
        return (f"; rung: fetch the weights from a peer, {', '.join(sorted(serving)[:3])} ({', '.join(holders)} {verb} "
                "them but cannot take it), else the mirror")
    why = "a multi-node start fetches from the mirror" if serving else "serving no peers"
    return f"; rung: fetch the weights from the mirror ({', '.join(holders)} {verb} them but cannot take it; {why})"


class Probe:
    """Whether one replica of `model` fits in `view`, kept current as the view changes.

    Per profile: the nodes that can take a shard now and, for a multi-node profile, how many of them each
    fabric has. Built in one sweep of the nodes (no refusal text is written); `update(node_ids)` re-judges
    only those nodes. `fits()` is what `place_one(model, view).kind == "place"` would say.
    """

    def __init__(self, model: Model, view: FleetView):
        self.model = model
        self.view = view
        self._ok: list[set[str]] = [set() for _ in model.profiles]
        self._fabric: list[dict[str, int]] = [{} for _ in model.profiles]
        self.update({n.id for n in view.nodes})

    def update(self, node_ids: set[str]) -> None:
        for i, profile in enumerate(self.model.profiles):
            ok, per_fabric = self._ok[i], self._fabric[i]
            multi = profile.shard_count > 1
            asks = fit_key(profile)
            for nid in node_ids:
                node = self.view.by_id.get(nid)
                if node is None:
                    continue
                now_ok = self.view.fit(profile, node, asks).ok
                if now_ok == (nid in ok):
                    continue
                (ok.add if now_ok else ok.discard)(nid)
                if multi:
                    for name in active_fabrics(node):
                        per_fabric[name] = per_fabric.get(name, 0) + (1 if now_ok else -1)

    def fits(self) -> bool:
        for i, profile in enumerate(self.model.profiles):
            if profile.shard_count == 1:
                if self._ok[i]:
                    return True
            elif any(count >= profile.shard_count for count in self._fabric[i].values()):
                return True
        return False
