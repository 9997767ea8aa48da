"""Which relay design for the hot path: each candidate measured against the sim engine in one run.

Starts the stack of overhead.py (sim engine with no delay, real `llmgw server`), plus one process per
candidate relay from relay_apps.py, every relay pinned to the same core. For each, one request at a time
interleaved with direct requests (added p50/p99, relay CPU per request), then `--concurrency` requests at
once (relay CPU per request, hence req/s per relay core). The last row is the real gateway, with routing,
keys, limits, breaker, metrics and the disconnect watch included.

Run: `.venv/bin/python bench/relays.py` (about two minutes). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import psutil

from common import Stack, latency, throughput
from llmgw.dev.procs import free_port, wait_port

CANDIDATES = [("fastapi-httpx", "asyncio"), ("fastapi-aiohttp", "asyncio"), ("asgi-aiohttp", "asyncio"),
              ("asgi-aiohttp", "uvloop"), ("asgi-llmgw", "uvloop")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per path in each latency phase")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0, help="per throughput run")
    ap.add_argument("--gateway-cpu", type=int, default=0)
    args = ap.parse_args()
    rows = []
    with Stack(args.gateway_cpu) as st:
        relays = []
        for kind, loop in CANDIDATES:
            port = free_port()
            app = str(Path(__file__).with_name("relay_apps.py"))
            p = st.spawn([sys.executable, app, kind, str(port), st.direct, loop], {args.gateway_cpu},
                         log=f"{kind}-{loop}")
            relays.append((f"{kind} ({loop})", f"http://127.0.0.1:{port}/v1/chat/completions", p, port))
        for name, url, p, port in relays:
            wait_port(port, 30, p, name)
        relays = [(n, u, psutil.Process(p.pid)) for n, u, p, _ in relays]
        relays.append(("llmgw gateway (uvloop)", st.gateway, st.gateway_proc))
        for name, url, proc in relays:
            lat = asyncio.run(latency(st.direct, url, args.requests, proc))
            thr = asyncio.run(throughput(url, args.concurrency, args.seconds, {"relay": proc}))
            rows.append((name, lat, thr))
            print(f"  measured {name}", file=sys.stderr)

    print(f"relay candidates vs direct to the sim engine (zero delay); every relay on cpu {args.gateway_cpu}, "
          f"engine + client on {sorted(st.others)}; {os.cpu_count()} cpus")
    print(f"{'relay':32s} {'added p50':>10s} {'added p99':>10s} {'CPU/req c=1':>12s} "
          f"{'CPU/req c=' + str(args.concurrency):>13s} {'req/s/core':>11s}")
    for name, lat, thr in rows:
        print(f"{name:32s} {lat['added_p50_ms']:8.3f}ms {lat['added_p99_ms']:8.3f}ms "
              f"{lat['gateway_cpu_us_per_request']:10.0f}us {thr['relay_cpu_us_per_request']:11.0f}us "
              f"{1e6 / thr['relay_cpu_us_per_request']:11.0f}")


if __name__ == "__main__":
    main()
