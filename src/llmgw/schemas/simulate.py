"""The `llmgw agent --simulate SPEC` format: a node's hardware, declared instead of discovered.

Every field is optional; what is left out is this machine's own (CPUs, memory, free disk under the
cache) or nothing (GPUs, adapters). See docs/catalog.md ("Simulated nodes") for examples.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmgw.schemas.inventory import HCA


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimGPU(_Strict):
    """One declared GPU. `nvlink_peers` are indices on the same node (the link is taken both ways)."""

    memory_gb: float | None = None  # default: the spec's gpu_memory_gb
    name: str | None = None
    nvlink_peers: list[int] = Field(default_factory=list)


class SimulatedNode(_Strict):
    """A declared node.

    - `gpus`: a count (all alike: `gpu_memory_gb`, `gpu_name`, NVLink by `nvlink`) or a list of `SimGPU`.
    - `nvlink`: with a count, `all` (every GPU a peer of every other, as on an NVSwitch board), `none`
      (the topology is unknown) or groups of indices whose members are peers (`[[0, 1], [2, 3]]`, as PCIe
      bridges pair cards).
    - `hcas`: InfiniBand adapters with the fabric they are declared on and their ports; one with no ACTIVE
      port is not advertised (as on real hardware).
    - `holds`: sources whose weights this node is to be taken to hold already (placement prefers it and
      skips its disk check). Only the inventory says so: a fetch still fetches what the cache lacks.
    - `engines`: restrict the engines advertised to these (default: what this machine can launch).
    - `cpus`, `memory_gb`, `disk_free_gb`: default to this machine's (disk: free space under the cache).
    """

    cpus: int | None = Field(None, ge=1)
    memory_gb: float | None = Field(None, ge=0)
    disk_free_gb: float | None = Field(None, ge=0)
    gpus: int | list[SimGPU] = 0
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_name: str = "Simulated GPU"
    nvlink: Literal["all", "none"] | list[list[int]] = "all"
    hcas: list[HCA] = Field(default_factory=list)
    holds: list[str] = Field(default_factory=list)
    engines: list[str] | None = None

    @model_validator(mode="after")
    def _indices(self) -> "SimulatedNode":
        n = self.gpus if isinstance(self.gpus, int) else len(self.gpus)
        if isinstance(self.gpus, int) and self.gpus < 0:
            raise ValueError("gpus: a count must be 0 or more")
        groups = self.nvlink if isinstance(self.nvlink, list) else []
        peers = [p for g in self.gpus for p in g.nvlink_peers] if isinstance(self.gpus, list) else []
        bad = sorted(i for i in {i for g in groups for i in g} | set(peers) if not 0 <= i < n)
        if bad:
            raise ValueError(f"GPU index {bad[0]} does not exist; this node declares {n} GPU(s), 0..{n - 1}")
        return self
