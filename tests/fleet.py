"""Builders for snapshots and simulated nodes, shared by the placement unit tests and the fleet tests."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from llmgw.schemas.catalog import Model
from llmgw.schemas.inventory import GPU, Fabric, Inventory
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap, ShardPlacement, Snapshot

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def node(node_id: str, gpus: int = 0, gpu_gb: float = 80, nvlink: bool = True, fabrics: dict[str, list[str]] | None = None,
         disk_gb: float = 1000, memory_gb: float = 256, cached: list[str] | None = None, engines: list[str] | None = None,
         age_s: float = 0, peers: dict[int, list[int]] | None = None) -> NodeSnap:
    """A node whose last heartbeat was `age_s` before NOW. `fabrics`: fabric name -> adapters."""
    gs = [GPU(index=i, memory_mb=int(gpu_gb * 1024),
              nvlink_peers=(peers or {}).get(i, [j for j in range(gpus) if j != i] if nvlink and peers is None else []))
          for i in range(gpus)]
    inv = Inventory(cpus=32, memory_mb=int(memory_gb * 1024), disk_free_mb=int(disk_gb * 1024), gpus=gs,
                    fabrics=[Fabric(name=n, adapters=a, rate_gbps=400) for n, a in (fabrics or {}).items()],
                    cached_sources=cached or [], engines=engines if engines is not None else ["sim", "llamacpp", "vllm"])
    return NodeSnap(id=node_id, status="ready", last_heartbeat=NOW - timedelta(seconds=age_s), inventory=inv)


def model(name: str, min: int = 1, max: int | None = None, priority: int = 0, idle_timeout: float = 600,
          **profile) -> Model:
    profile.setdefault("engine", "sim")
    return Model.model_validate({"name": name, "priority": priority, "profiles": [profile],
                                 "scaling": {"min": min, "max": min if max is None else max, "idle_timeout": idle_timeout}})


def replica(rid: str, model_name: str, shards: list[tuple[str, list[int]]], status: str = "ready",
            age_s: float = 100, settled: bool = False, profile: str = "default") -> ReplicaSnap:
    return ReplicaSnap(id=rid, model=model_name, profile=profile, status=status, settled=settled,
                       created_at=NOW - timedelta(seconds=age_s),
                       shards=[ShardPlacement(node_id=n, rank=i, gpus=g) for i, (n, g) in enumerate(shards)])


def snapshot(models: list[Model], nodes: list[NodeSnap], replicas: list[ReplicaSnap] | None = None,
             states: list[ModelState] | None = None, unreachable_after_s: float = 15, lost_after_s: float = 300) -> Snapshot:
    return Snapshot(now=NOW, unreachable_after_s=unreachable_after_s, lost_after_s=lost_after_s, models=models,
                    model_states=states or [], nodes=nodes, replicas=replicas or [])


def sim_spec(gpus: int = 0, gpu_memory_gb: float = 80, fabric: str | None = None, port_state: str = "ACTIVE",
             **extra) -> str:
    """An inline `--simulate` spec (JSON is YAML)."""
    spec: dict = {"gpus": gpus, "gpu_memory_gb": gpu_memory_gb, **extra}
    if fabric:
        spec["hcas"] = [{"name": "mlx5_0", "fabric": fabric, "ports": [{"state": port_state, "rate_gbps": 400}]}]
    return json.dumps(spec)
