"""Simulated nodes: `llmgw agent --simulate SPEC` reports a declared inventory instead of discovering one.

With the sim engine this runs the whole control plane on a laptop: several agents, each declaring GPUs
with memory and NVLink peers, InfiniBand adapters on fabrics, and disk, give placement, the fabric rule,
multi-node tensor-parallel replicas, node loss and preemption real work to do. The declared inventory
replaces only discovery's output; everything else (registration, heartbeats, activities, engines) is
the ordinary node worker, so what a test sees is the real path.

SPEC is a path to a YAML or JSON file, or the YAML/JSON text itself (`--simulate '{gpus: 4}'`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import yaml
from pydantic import ValidationError

from llmgw.schemas.inventory import GPU, Inventory
from llmgw.schemas.simulate import SimulatedNode
from llmgw.weights.naming import cache_name_for
from llmgw.node.fabric import advertise_fabrics


class SimulateError(ValueError):
    """The spec cannot be read; the message names the field."""


def load_spec(spec: str) -> SimulatedNode:
    """Read SPEC (a file path, or inline YAML/JSON). Raises `SimulateError` naming the bad field."""
    path = Path(spec)
    try:
        text = path.read_text() if len(spec) < 4096 and "\n" not in spec and path.is_file() else spec
    except OSError as exc:
        raise SimulateError(f"--simulate {spec}: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SimulateError(f"--simulate: neither a file nor valid YAML/JSON: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SimulateError(f"--simulate: expected a mapping such as {{gpus: 4, gpu_memory_gb: 80}}, got {raw!r}")
    try:
        # An operator's spec: a typo is refused at every depth, the wire models it embeds (HCA) included.
        return SimulatedNode.model_validate(raw, extra="forbid")
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"]) or "spec"
            msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {msg}")
        raise SimulateError("--simulate: " + "; ".join(problems)) from None


def simulated_gpus(spec: SimulatedNode) -> list[GPU]:
    """The declared GPUs, indices 0..n-1, with NVLink peers made symmetric."""
    if isinstance(spec.gpus, int):
        n = spec.gpus
        if spec.nvlink == "all":
            peers = {i: {j for j in range(n) if j != i} for i in range(n)}
        elif spec.nvlink == "none":
            peers = {i: set() for i in range(n)}
        else:
            peers = {i: set() for i in range(n)}
            for group in spec.nvlink:
                for i in group:
                    peers[i] |= {j for j in group if j != i}
        mem = {i: spec.gpu_memory_gb for i in range(n)}
        names = {i: spec.gpu_name for i in range(n)}
    else:
        n = len(spec.gpus)
        peers = {i: set(g.nvlink_peers) - {i} for i, g in enumerate(spec.gpus)}
        for i in range(n):
            for j in list(peers[i]):
                peers[j].add(i)
        mem = {i: g.memory_gb or spec.gpu_memory_gb for i, g in enumerate(spec.gpus)}
        names = {i: g.name or spec.gpu_name for i, g in enumerate(spec.gpus)}
    return [GPU(index=i, uuid=f"SIM-GPU-{i}", name=names[i], memory_mb=int(mem[i] * 1024),
                nvlink_peers=sorted(peers[i])) for i in range(n)]


def simulated_inventory(spec: SimulatedNode, cache_dir: Path, engines: list[str], cached: list[str]) -> Inventory:
    """The inventory a simulated node reports. Memory and disk in MiB, as discovery reports them.

    `engines` and `cached` are what this machine really has (adapters, cache names present); the spec
    narrows the engines and adds the sources it declares held.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    fabrics, notes = advertise_fabrics(spec.hcas)
    if spec.engines is not None:
        missing = sorted(set(spec.engines) - set(engines))
        if missing:
            notes.append(f"declared engine(s) {', '.join(missing)} cannot be launched on this machine; not advertised")
        engines = [e for e in engines if e in spec.engines]
    held = sorted(set(cached) | {cache_name_for(s) for s in spec.holds})
    return Inventory(
        cpus=spec.cpus or os.cpu_count() or 1,
        memory_mb=int(spec.memory_gb * 1024) if spec.memory_gb is not None else int(psutil.virtual_memory().total // (1 << 20)),
        disk_free_mb=(int(spec.disk_free_gb * 1024) if spec.disk_free_gb is not None
                      else int(shutil.disk_usage(cache_dir).free // (1 << 20))),
        gpus=simulated_gpus(spec),
        fabrics=fabrics,
        cached_sources=held,
        engines=engines,
        simulated=True,
        notes=["simulated inventory (llmgw agent --simulate)", *notes],
    )
