"""Decision objects: what a reconcile pass does and why. Explaining a pass is printing them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import ShardPlacement
from llmgw.schemas.status import ReplicaStatus

DecisionKind = Literal["place", "stop", "evict", "lost", "cleanup", "refuse", "wait", "keep", "rollout", "sleep",
                       "wake", "stage"]


REFUSED = "cannot place"


REFUSAL_REASONS_SHOWN = 3  # the candidates' distinct reasons a refusal carries (`ctl explain` has them all)


def refusal(lines: list[str], model: str) -> str | None:
    """The reason in a pass's lines (`Plan.explanations()[model]`) when it refused to place `model`, else None:
    its line, and what turned its candidates down (their distinct reasons, without the profile and node
    each line names: "has no GPU (needs 1)"), so that `ctl models` and a client's 503 say why, not only
    that no node can take it."""
    head = f"{REFUSED} {model}: "
    for i, line in enumerate(lines):
        if not line.startswith(head):
            continue
        reasons: list[str] = []
        for candidate in lines[i + 1:]:
            if not candidate.startswith("  "):  # (an indented line is one candidate turned down)
                break
            why = candidate.strip().split(": ", 1)[-1]
            if why not in reasons:
                reasons.append(why)
        said = "; ".join(reasons[:REFUSAL_REASONS_SHOWN])
        if len(reasons) > REFUSAL_REASONS_SHOWN:
            said += f"; and {len(reasons) - REFUSAL_REASONS_SHOWN} more"
        return line[len(head):] + (f" ({said})" if said else "")
    return None


class Decision(BaseModel):
    """One thing a pass decided.

    - `place`: start a replica of `model`/`profile` on `shards`.
    - `stop`: drain then stop `replica_id` (`drain` False stops at once, for a replica that cannot serve).
    - `evict`: drain then stop `replica_id` of a lower-priority model so that `for_model` can be placed.
    - `lost`: `replica_id` is gone with its node; mark it lost and stop any shard left on other nodes.
    - `cleanup`: `replica_id` ended (`failed`/`lost`) and may have shards still running: stop every one,
      and count a failure against the model's backoff.
    - `refuse`: `model` needs a replica and nothing can take it; `refusals` give each candidate's reason.
    - `wait`: `model` needs a replica but is held back (backoff, drains in progress, evictions, the most
      placements or evictions one pass makes).
    - `keep`: nothing to do for `model`; `reason` says what it has and why that is what it wants.
    - `rollout`: some of `model`'s replicas run an older profile: make sure its `RolloutWorkflow` runs.
    - `sleep`: put Ready `replica_id` to sleep (out of routing, engine kept, accelerator memory released);
    - `wake`: wake sleeping `replica_id` (placement/sleep.py).
    - `stage`: fetch `model`'s weights onto `shards[0]`'s node ahead of its next start (placement/prestage.py);
      carried out by `decide` itself, never an action of the reconciler's workflow.
    `sleep_mode` (a `place`): its engine is launched able to sleep (the model has `scaling.sleep_after`).
    """

    model_config = ConfigDict(extra="forbid")

    kind: DecisionKind
    model: str
    reason: str
    replica_id: str | None = None
    profile: str | None = None
    profile_spec: Profile | None = None
    shards: list[ShardPlacement] = Field(default_factory=list)
    refusals: list[str] = Field(default_factory=list)
    drain: bool = True
    to_zero: bool = False  # a `stop` of a model wanted at zero now (idle, not asked for): it waits for a request
    final_status: ReplicaStatus = ReplicaStatus.STOPPED  # what a stop/evict/lost/cleanup leaves the replica as
    for_model: str | None = None  # evict: the model the room is made for
    sleep_mode: bool = False

    def line(self) -> str:
        """One human-readable line (used in logs, traces and `llmgw ctl explain`)."""
        return f"{_HEADS[self.kind](self, (self.replica_id or '')[:8])}: {self.reason}"


# The start of `Decision.line()` for each kind (only the one asked for is written: a pass has a line per model).
_HEADS = {
    "place": lambda d, rid: f"place {d.model}/{d.profile} on " + ", ".join(
        f"{s.node_id}[rank {s.rank}" + (f", GPUs {','.join(map(str, s.gpus))}]" if s.gpus else "]")
        for s in d.shards),
    "stop": lambda d, rid: f"{'drain and stop' if d.drain else 'stop'} replica {rid} of {d.model}",
    "evict": lambda d, rid: f"evict replica {rid} of {d.model} (drain, then stop)",
    "lost": lambda d, rid: f"replica {rid} of {d.model} is lost",
    "cleanup": lambda d, rid: f"stop every shard of {d.final_status} replica {rid} of {d.model}",
    "refuse": lambda d, rid: f"{REFUSED} {d.model}",
    "wait": lambda d, rid: f"hold {d.model}",
    "keep": lambda d, rid: f"keep {d.model}",
    "rollout": lambda d, rid: f"roll out {d.model}",
    "sleep": lambda d, rid: f"put replica {rid} of {d.model} to sleep",
    "wake": lambda d, rid: f"wake replica {rid} of {d.model}",
    "stage": lambda d, rid: f"stage {d.model}'s weights on {d.shards[0].node_id if d.shards else '?'}",
}


class Plan(BaseModel):
    """A pass's decisions. `more` is True when the pass stopped short (placements or evictions left for the
    next pass, which then runs at once)."""

    model_config = ConfigDict(extra="forbid")

    decisions: list[Decision] = Field(default_factory=list)
    node_status: dict[str, str] = Field(default_factory=dict)
    more: bool = False

    def of_kind(self, kind: str) -> list[Decision]:
        return [d for d in self.decisions if d.kind == kind]

    def for_model(self, model: str) -> list[Decision]:
        return [d for d in self.decisions if d.model == model]

    def explanations(self) -> dict[str, list[str]]:
        """Model → this pass's lines about it, each refusal indented under its decision."""
        out: dict[str, list[str]] = {}
        for d in self.decisions:
            out.setdefault(d.model, []).append(d.line())
            out[d.model].extend(f"  {r}" for r in d.refusals)
        return out

    def acts(self) -> bool:
        """True when the pass changes something (anything but keep, wait and refuse)."""
        return any(d.kind not in ("keep", "wait", "refuse", "rollout") for d in self.decisions)
