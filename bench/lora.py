"""LoRA adapters (issue 40): request -> first token for a cold adapter (its load included) against a warm
one, and the throughput of one replica serving 8 adapters against the same replica serving its base alone,
in one run.

Starts an embedded PostgreSQL, a Temporal dev server, `llmgw server`, `llmgw worker` and one simulated
`llmgw agent` on free ports; applies one sim base (`min: 1`, `max_loras: 8`, `--tokens-per-second 0`,
`--lora-load-s` as given: the engine's own load time, 0 by default so the figure is the gateway's path)
with 8 adapters, and waits for its replica. Then:

- cold vs warm: for each adapter, one streaming request while no replica holds it (the gateway loads it
  first: the load call, its row in Postgres), then one while it is loaded; paired by adapter;
- throughput: `--concurrency` clients for `--seconds` on the base, then round-robin over the 8 adapters
  (all loaded: no load during the run), alternating `--rounds` times.

    .venv/bin/python bench/lora.py [--lora-load-s 0] [--concurrency 16] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.coldstart import first_token, pct  # noqa: E402
from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from tests.fleet import sim_spec  # noqa: E402
from tests.helpers import ControlPlane  # noqa: E402

ADAPTERS = [f"lora-{i}" for i in range(8)]


async def throughput(gateway: str, models: list[str], concurrency: int, seconds: float) -> float:
    """Requests per second answered (non-streaming, 4 tokens), the `model` of each taken round-robin."""
    names = itertools.cycle(models)
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def one() -> None:
            body = json.dumps({"model": next(names), "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 4}).encode()
            async with s.post(gateway + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
        for _ in range(20):  # warm the connections
            await one()
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one()
                done += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora-load-s", type=float, default=0.0, help="the sim engine's own load time per adapter")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-lora-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "pg.log", database="bench", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log", namespaces=["bench"])
    cp = None
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_TEMPORAL_NAMESPACE="bench")
        cp.start()
        cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=256))
        cp.wait_nodes("n1")
        r = cp.apply({"models": [{
            "name": "base", "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "sim", "max_loras": len(ADAPTERS),
                          "args": ["--tokens-per-second", "0", "--lora-load-s", str(args.lora_load_s)]}],
            "adapters": [{"name": n, "source": f"/adapters/{n}"} for n in ADAPTERS]}]})
        assert r.status_code == 200, r.text
        cp.wait_replicas("base", "ready", 1, timeout_s=120)
        asyncio.run(first_token(cp.gateway, "base"))  # the route table has the replica
        time.sleep(1)
        cold, warm = [], []
        for n in ADAPTERS:
            cold.append(asyncio.run(first_token(cp.gateway, n))[1])
            warm.append(asyncio.run(first_token(cp.gateway, n))[1])
        print(f"{'first token':<34}{'p50 ms':>10}{'p90 ms':>10}")
        print(f"{'cold adapter (load included)':<34}{pct(cold, 0.5) * 1000:>10.1f}{pct(cold, 0.9) * 1000:>10.1f}")
        print(f"{'warm adapter':<34}{pct(warm, 0.5) * 1000:>10.1f}{pct(warm, 0.9) * 1000:>10.1f}")
        added = [c - w for c, w in zip(cold, warm)]
        print(f"{'cold - warm, paired by adapter':<34}{pct(added, 0.5) * 1000:>10.1f}{pct(added, 0.9) * 1000:>10.1f}"
              f"   (engine's own load time {args.lora_load_s * 1000:.0f} ms)")
        print(f"\nthroughput, c={args.concurrency}, {args.seconds:g} s each, alternating:")
        base, lora = [], []
        for _ in range(args.rounds):
            base.append(asyncio.run(throughput(cp.gateway, ["base"], args.concurrency, args.seconds)))
            lora.append(asyncio.run(throughput(cp.gateway, ADAPTERS, args.concurrency, args.seconds)))
            print(f"  base alone {base[-1]:8.1f} req/s   8 adapters round-robin {lora[-1]:8.1f} req/s   "
                  f"ratio {lora[-1] / base[-1]:.2f}")
        print(f"\n{datetime.now():%Y-%m-%d %H:%M}, load average {open('/proc/loadavg').read().split()[0]}")
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
