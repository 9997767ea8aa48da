"""What a node reports about itself: hardware inventory and the shards it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GPU(_Strict):
    """One GPU. `memory_mb` is total memory in MiB; `nvlink_peers` are indices on the same node."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_mb: int = 0
    nvlink_peers: list[int] = Field(default_factory=list)


class Fabric(_Strict):
    """An InfiniBand fabric this node is on, with the adapters (HCAs) that have an ACTIVE port.

    `rate_gbps` is the slowest active link: a collective runs at the speed of its slowest member.
    """

    name: str
    adapters: list[str] = Field(default_factory=list)
    rate_gbps: float = 0.0


class Inventory(_Strict):
    """A node's hardware. Memory and disk in MiB; `disk_free_mb` is free space under the weight cache."""

    cpus: int = 0
    memory_mb: int = 0
    disk_free_mb: int = 0
    gpus: list[GPU] = Field(default_factory=list)
    fabrics: list[Fabric] = Field(default_factory=list)
    cached_sources: list[str] = Field(default_factory=list)  # cache names of weights already on disk
    engines: list[str] = Field(default_factory=list)  # engines this node can launch
    simulated: bool = False
    notes: list[str] = Field(default_factory=list)  # discovery remarks (no NVIDIA driver, adapter missing, ...)


ShardState = Literal["starting", "ready", "draining", "stopped", "failed"]


class ShardReport(_Strict):
    """One shard as the node sees it. Sent on register (every running shard) and on each transition."""

    shard_id: str
    replica_id: str
    model: str
    profile: str
    rank: int = 0
    gpus: list[int] = Field(default_factory=list)
    state: ShardState
    pid: int | None = None
    endpoint: str | None = None
    exit_code: int | None = None
    output_tail: str | None = None
    profile_hash: str | None = None  # `profile_hash()` of the profile it was launched with (adoption)
