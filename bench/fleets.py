"""Synthetic fleets for the planner bench (`bench/planner.py`): 8-GPU nodes, mixed tp 1/2/4/8 models.

Deterministic (seeded), so two runs, or two planners in one run, see the same fleet.

- `packed(n)`: `n` nodes (8 x 80 GB, NVLink, fabrics of 32 nodes), `n / 2` models with 3 replicas each,
  tp cycling 1, 2, 4, 8, placed "spread": largest first, and within a size in a shuffled order, each on the
  node with the most free GPUs (what a fleet looks like after a rollout moved replicas around). About 70 %
  of the GPUs are held and no node has eight free, so a tp-8 model can only be placed by evicting.
- `empty(n, models)`: the same nodes and nothing running; every model wants one replica.
"""

from __future__ import annotations

import heapq
import random
from datetime import datetime, timedelta, timezone

from llmgw.placement.fit import pick_gpus
from llmgw.schemas.catalog import Model
from llmgw.schemas.inventory import GPU, Fabric, Inventory
from llmgw.schemas.payloads import ModelState, NodeSnap, ReplicaSnap, ShardPlacement, Snapshot
from llmgw.weights.naming import cache_name_for

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GPUS = 8
REPLICAS = 3
FABRIC_NODES = 32


def nodes(n: int) -> list[NodeSnap]:
    peers = {i: [j for j in range(GPUS) if j != i] for i in range(GPUS)}
    out = []
    for i in range(n):
        inv = Inventory(cpus=128, memory_mb=1024 * 1024, disk_free_mb=4000 * 1024, engines=["vllm", "sim"],
                        gpus=[GPU(index=g, memory_mb=80 * 1024, nvlink_peers=peers[g]) for g in range(GPUS)],
                        fabrics=[Fabric(name=f"ib-{i // FABRIC_NODES}", adapters=["mlx5_0"], rate_gbps=400)])
        out.append(NodeSnap(id=f"node-{i:05d}", status="ready", last_heartbeat=NOW - timedelta(seconds=1),
                            inventory=inv))
    return out


def model(i: int, tp: int, replicas: int = REPLICAS, priority: int | None = None, name: str | None = None) -> Model:
    """Model `i`. tp-8 models run at priority 5 unless told: as high as the model that evicts in the bench, so
    only the spread smaller replicas are candidates and the search has to go through most of them."""
    return Model.model_validate({
        "name": name or f"model-{i:05d}", "priority": (5 if tp == 8 else 0) if priority is None else priority,
        "scaling": {"min": replicas, "max": replicas},
        "profiles": [{"engine": "vllm", "source": f"mirror:model-{i}.bin", "tp": tp, "gpu_memory_gb": 40,
                      "disk_gb": 20}]})


def models(count: int, replicas: int = REPLICAS) -> list[Model]:
    return [model(i, (1, 2, 4, 8)[i % 4], replicas) for i in range(count)]


def states(ms: list[Model], rng: random.Random) -> list[ModelState]:
    return [ModelState(name=m.name, last_used_at=NOW - timedelta(seconds=rng.randint(1, 86400))) for m in ms]


def packed(n: int, seed: int = 1) -> Snapshot:
    """The fleet with every model at its `min`, replicas spread (see the module docstring)."""
    rng = random.Random(seed)
    ns = nodes(n)
    ms = models(n // 2)
    free = {x.id: set(range(GPUS)) for x in ns}
    peers = {g: set(p) for g, p in ((g.index, g.nvlink_peers) for g in ns[0].inventory.gpus)}
    heap = [(-GPUS, x.id) for x in ns]  # most free GPUs first
    heapq.heapify(heap)
    wanted = [(m, k) for m in ms for k in range(REPLICAS)]
    rng.shuffle(wanted)
    wanted.sort(key=lambda mk: -mk[0].profiles[0].tp)  # big first (stable: shuffled within a size)
    reps: list[ReplicaSnap] = []
    cached: dict[str, list[str]] = {x.id: [] for x in ns}
    for m, k in wanted:
        tp = m.profiles[0].gpus_per_shard
        _, nid = heapq.heappop(heap)
        if len(free[nid]) < tp:  # the emptiest node has no room: no node has (not at 70 %); skip it
            heapq.heappush(heap, (-len(free[nid]), nid))
            continue
        gpus, _ = pick_gpus(sorted(free[nid]), peers, tp)
        free[nid] -= set(gpus)
        heapq.heappush(heap, (-len(free[nid]), nid))
        reps.append(ReplicaSnap(id=f"{m.name}-r{k}-{rng.getrandbits(32):08x}", model=m.name, profile="default",
                                status="ready", created_at=NOW - timedelta(seconds=rng.randint(600, 864000)),
                                shards=[ShardPlacement(node_id=nid, rank=0, gpus=gpus)]))
        cached[nid].append(cache_name_for(m.profiles[0].source or ""))
    for x in ns:
        x.inventory.cached_sources = cached[x.id]
    return Snapshot(now=NOW, models=ms, model_states=states(ms, rng), nodes=ns, replicas=reps)


def empty(n: int, count: int, seed: int = 1) -> Snapshot:
    """`n` idle nodes and `count` models (mixed tp) wanting one replica each."""
    rng = random.Random(seed)
    ms = models(count, replicas=1)
    return Snapshot(now=NOW, models=ms, model_states=states(ms, rng), nodes=nodes(n), replicas=[])
