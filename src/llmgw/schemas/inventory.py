"""What a node reports about itself: hardware inventory and the shards it runs.

Sent by nodes to the node API and carried in workflow payloads: unknown fields from a newer node are
ignored (`schemas/wire.py`). The one operator surface that embeds these models, a `--simulate` inventory,
refuses them at its own call (`node/simulate.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from llmgw.schemas.status import ShardStatus
from llmgw.schemas.wire import WireModel as _Wire


# What a node may report (the node API stores it in int32 columns and text the operator reads): a pid
# or rank past int32 had been a 500 with the registration rolled back.
MAX_GPUS = 64  # per node; no machine has more
PID_MAX = 2**22  # Linux's pid_max ceiling
TEXT_MAX = 65536  # an exit's words, an output tail (the agent sends the last few KiB)


def _id():
    return Field(max_length=200)


class GPU(_Wire):
    """One GPU. `memory_mb` is total memory in MiB; `nvlink_peers` are indices on the same node."""

    index: int = Field(ge=0, lt=MAX_GPUS)
    uuid: str = Field("", max_length=200)
    name: str = Field("", max_length=200)
    memory_mb: int = Field(0, ge=0, le=2**31 - 1)
    nvlink_peers: list[int] = Field(default_factory=list, max_length=MAX_GPUS)


class HCAPort(_Wire):
    """One port of an InfiniBand adapter as discovery (or a simulated inventory) sees it.

    `state` is the port's logical state as sysfs spells it (`ACTIVE`, `INIT`, `DOWN`, `ARMED`); only
    `ACTIVE` carries traffic: a port with a link and no subnet manager sits in INIT (seeds 001).
    """

    number: int = 1
    state: str = "ACTIVE"
    rate_gbps: float = 400.0


class HCA(_Wire):
    """An InfiniBand adapter (HCA, for example `mlx5_0`) and the fabric the operator declared it is on.

    Fabric membership is configuration, not inferred: OpenSM's default subnet prefix is the same on every
    fabric, so nothing on the wire tells two fabrics apart (seeds 001, "Stop trusting hardware facts").
    """

    name: str
    fabric: str
    ports: list[HCAPort] = Field(default_factory=lambda: [HCAPort()])


class Fabric(_Wire):
    """An InfiniBand fabric this node is on, with the adapters (HCAs) that have an ACTIVE port.

    `rate_gbps` is the slowest active link: a collective runs at the speed of its slowest member.
    """

    name: str
    adapters: list[str] = Field(default_factory=list)
    rate_gbps: float = 0.0


class PeerRef(_Wire):
    """A node that holds a cache entry, and its peer listener (node/peer_server.py; issue 39)."""

    node_id: str = Field("", max_length=253)
    url: str = Field("", max_length=300)


class Inventory(_Wire):
    """A node's hardware. Memory and disk in MiB; `disk_free_mb` is free space under the weight cache."""

    cpus: int = Field(0, ge=0, le=1 << 20)
    memory_mb: int = Field(0, ge=0, le=1 << 40)
    disk_free_mb: int = Field(0, ge=0, le=1 << 50)
    gpus: list[GPU] = Field(default_factory=list, max_length=MAX_GPUS)
    fabrics: list[Fabric] = Field(default_factory=list, max_length=64)
    cached_sources: list[str] = Field(default_factory=list, max_length=100_000)  # cache names of weights on disk
    engines: list[str] = Field(default_factory=list, max_length=16)  # engines this node can launch
    simulated: bool = False
    notes: list[str] = Field(default_factory=list, max_length=100)  # discovery remarks (no NVIDIA driver, ...)
    # Its peer listener, serving its cache to other nodes over mutual TLS (node/peer_server.py): pinned by the
    # node API to the node's own addresses, as an engine endpoint is; None when it serves none. Sent only to a
    # control plane whose registration answer said `peers` (schemas/api.py).
    peer_url: str | None = Field(None, max_length=300, pattern=r"^https://[^\s/?#@]+$", exclude_if=lambda v: v is None)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, v: list[GPU]) -> list[GPU]:
        """Each GPU once: two with one index had both been handed to shards, one device twice."""
        seen = [g.index for g in v]
        if len(seen) != len(set(seen)):
            raise ValueError(f"GPU indices {seen} name a GPU twice; report each GPU once")
        return v


# What a node reports of a shard: every `ShardStatus` but `lost`, which only the control plane decides.
ShardState = Literal[ShardStatus.STARTING, ShardStatus.READY, ShardStatus.DRAINING, ShardStatus.STOPPED,
                     ShardStatus.FAILED]


class AdapterFile(_Wire):
    """A LoRA adapter's file as the node fetched and verified it for a shard (issue 40), or why not.

    `path`: the node-local verified copy the engine is given (vLLM's `lora_path`; llama.cpp's `--lora`);
    `error`: why it is not there (a hash that did not match the mirror's, a missing file): the engine is never
    given it, and the gateway answers its requests 503 `adapter_unverified` with these words; `id`: its index
    among the engine's launch adapters (llama.cpp's per-request `lora` ids; None elsewhere)."""

    path: str | None = Field(None, max_length=4096)
    error: str | None = Field(None, max_length=2000)
    id: int | None = Field(None, ge=0, le=1024)


class ShardReport(_Wire):
    """One shard as the node sees it. Sent on register (every running shard) and on each transition."""

    shard_id: str = _id()
    replica_id: str = _id()
    model: str = Field(max_length=200)  # empty in a `stopped` report of a shard the agent no longer knows
    profile: str = Field(max_length=200)
    rank: int = Field(0, ge=0, le=4096)
    gpus: list[int] = Field(default_factory=list, max_length=MAX_GPUS)
    state: ShardState
    pid: int | None = Field(None, ge=1, le=PID_MAX)
    endpoint: str | None = Field(None, max_length=2048)
    exit_code: int | None = Field(None, ge=-255, le=255)  # a negative one is the signal (Popen.returncode)
    exit_reason: str | None = Field(None, max_length=TEXT_MAX)  # the exit in words ("killed by SIGILL ...")
    output_tail: str | None = Field(None, max_length=TEXT_MAX)
    profile_hash: str | None = Field(None, max_length=200)  # `profile_hash()` it was launched with (adoption)
    # The engine's key (serving shards), which the gateway sends; sent on registration and transitions,
    # stored with the shard, never logged (repr) nor shown by the admin API.
    api_key: str | None = Field(None, repr=False, pattern=r"^[A-Za-z0-9_-]{16,256}$")
    # Rank 0's adapter files by adapter name (issue 40); left out when it has none (an older control plane).
    adapters: dict[str, AdapterFile] | None = Field(None, max_length=256, exclude_if=lambda v: v is None)


class DownloadProgress(_Wire):
    """Weights being fetched for a replica on this node. `total` is None when the server sent no length:
    no percentage is invented (seeds 001, "Carry a download's progress to where somebody is looking")."""

    replica_id: str = _id()
    source: str = Field(max_length=4096)
    bytes: int = Field(ge=0, le=2**62)
    total: int | None = Field(None, ge=0, le=2**62)
