"""Decision objects: what a reconcile pass does and why. Explaining a pass is printing them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import ShardPlacement


class Decision(BaseModel):
    """One thing a pass decided.

    - `place`: start a replica of `model`/`profile` on `shards`.
    - `stop`: drain then stop `replica_id` (`drain` False stops at once, for a replica that cannot serve).
    - `lost`: `replica_id` is gone with its node; record it and stop any shard left elsewhere.
    - `refuse`: `model` needs a replica and nothing can take it; `refusals` give each candidate's reason.
    - `wait`: `model` needs a replica but is held back (backoff, another placement this pass).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["place", "stop", "lost", "refuse", "wait"]
    model: str
    reason: str
    replica_id: str | None = None
    profile: str | None = None
    profile_spec: Profile | None = None
    shards: list[ShardPlacement] = Field(default_factory=list)
    refusals: list[str] = Field(default_factory=list)
    drain: bool = True

    def line(self) -> str:
        """One human-readable line (used in logs, traces and `llmgw ctl explain`)."""
        head = {
            "place": f"place {self.model}/{self.profile} on " + ", ".join(f"{s.node_id}[rank {s.rank}]" for s in self.shards),
            "stop": f"{'drain and stop' if self.drain else 'stop'} replica {self.replica_id} of {self.model}",
            "lost": f"replica {self.replica_id} of {self.model} is lost",
            "refuse": f"cannot place {self.model}",
            "wait": f"hold {self.model}",
        }[self.kind]
        return f"{head}: {self.reason}"


class Plan(BaseModel):
    """A pass's decisions. `more` is True when the pass stopped early (one placement per pass)."""

    model_config = ConfigDict(extra="forbid")

    decisions: list[Decision] = Field(default_factory=list)
    node_status: dict[str, str] = Field(default_factory=dict)
    more: bool = False

    def of_kind(self, kind: str) -> list[Decision]:
        return [d for d in self.decisions if d.kind == kind]

    def explanations(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for d in self.decisions:
            out.setdefault(d.model, []).append(d.line())
            out[d.model].extend(f"  {r}" for r in d.refusals)
        return out
