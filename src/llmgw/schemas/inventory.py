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


class HCAPort(_Strict):
    """One port of an InfiniBand adapter as discovery (or a simulated inventory) sees it.

    `state` is the port's logical state as sysfs spells it (`ACTIVE`, `INIT`, `DOWN`, `ARMED`); only
    `ACTIVE` carries traffic: a port with a link and no subnet manager sits in INIT (seeds 001).
    """

    number: int = 1
    state: str = "ACTIVE"
    rate_gbps: float = 400.0


class HCA(_Strict):
    """An InfiniBand adapter (HCA, for example `mlx5_0`) and the fabric the operator declared it is on.

    Fabric membership is configuration, not inferred: OpenSM's default subnet prefix is the same on every
    fabric, so nothing on the wire tells two fabrics apart (seeds 001, "Stop trusting hardware facts").
    """

    name: str
    fabric: str
    ports: list[HCAPort] = Field(default_factory=lambda: [HCAPort()])


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
    exit_reason: str | None = None  # the exit in words, from the engine's adapter ("killed by SIGILL ...")
    output_tail: str | None = None
    profile_hash: str | None = None  # `profile_hash()` of the profile it was launched with (adoption)
    # The engine's key (serving shards), which the gateway sends; sent on registration and transitions,
    # stored with the shard, never logged (repr) nor shown by the admin API.
    api_key: str | None = Field(None, repr=False, pattern=r"^[A-Za-z0-9_-]{16,256}$")


class DownloadProgress(_Strict):
    """Weights being fetched for a replica on this node. `total` is None when the server sent no length:
    no percentage is invented (seeds 001, "Carry a download's progress to where somebody is looking")."""

    replica_id: str
    source: str
    bytes: int
    total: int | None = None
