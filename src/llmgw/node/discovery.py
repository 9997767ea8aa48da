"""Hardware discovery on a node: CPUs, memory, disk free under the cache, GPUs via NVML.

Runs, and says so in `Inventory.notes`, on a machine with no NVIDIA driver (a CPU node: llama.cpp on
CPU and the sim engine).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import psutil

from llmgw.schemas.inventory import GPU, Fabric, Inventory

log = logging.getLogger(__name__)


def discover_gpus() -> tuple[list[GPU], str | None]:
    """GPUs with memory and NVLink peers from NVML; ([], why) when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return [], "pynvml is not installed; no GPUs discovered"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"no NVIDIA driver ({exc}); this is a CPU node"
    try:
        gpus = []
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            peers = []
            for j, other in enumerate(handles):
                if j == i:
                    continue
                try:
                    status = pynvml.nvmlDeviceGetP2PStatus(h, other, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    if status == pynvml.NVML_P2P_STATUS_OK:
                        peers.append(j)
                except Exception:  # noqa: BLE001 - topology unknown for this pair
                    pass
            gpus.append(GPU(index=i, uuid=str(uuid), name=str(name), memory_mb=int(mem.total // (1 << 20)), nvlink_peers=peers))
        return gpus, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def discover(cache_dir: Path, engines: list[str], cached: list[str],
             gpus: tuple[list[GPU], str | None] | None = None,
             fabrics: tuple[list[Fabric], list[str]] | None = None) -> Inventory:
    """The node's inventory now. Memory and disk in MiB. `gpus` reuses an earlier NVML discovery and
    `fabrics` an earlier InfiniBand one (`workers.infiniband.discover_fabrics`)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found, note = gpus if gpus is not None else discover_gpus()
    ib, ib_notes = fabrics if fabrics is not None else ([], [])
    notes = ([note] if note else []) + list(ib_notes)
    return Inventory(
        cpus=os.cpu_count() or 1,
        memory_mb=int(psutil.virtual_memory().total // (1 << 20)),
        disk_free_mb=int(shutil.disk_usage(cache_dir).free // (1 << 20)),
        gpus=found,
        fabrics=ib,
        engines=engines,
        cached_sources=cached,
        notes=notes,
    )
