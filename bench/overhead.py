"""Gateway overhead against the sim engine, measured in one run: direct-to-engine vs through the gateway.

What it starts: an embedded PostgreSQL (the gateway's route table), the sim engine with no token delay
(`--tokens-per-second 0`) and a real `llmgw server` whose catalog routes the model `bench` to that engine
as a static endpoint. The gateway is pinned to one core (`--gateway-cpu`), the engine and this load
generator to the others, so "per gateway core" means what it says.

What it prints (every gateway figure next to the direct one measured in the same run):
- latency at one request at a time, interleaved direct/gateway: p50 and p99, and what the gateway adds;
- gateway CPU time per request (user + system of the gateway process, over the same requests);
- throughput at `--concurrency` for `--seconds`: req/s direct and through the gateway, the gateway's core
  utilisation, and req/s per gateway core (requests / gateway CPU seconds), which is the rate one core
  sustains even when the engine or this client is the bottleneck;
- streaming relay: SSE events/s and MB/s of one long stream, direct and through the gateway;
- the sim engine alone: its own CPU time per request (it may be the bottleneck, not the gateway).

Run: `.venv/bin/python bench/overhead.py` (about a minute). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil

from llmgw.db.migrate import upgrade
from llmgw.dev.postgres import EmbeddedPostgres
from llmgw.dev.procs import free_port, stop_process, wait_port

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def pinned(cpus: set[int]):
    def fn() -> None:
        os.sched_setaffinity(0, cpus)
    return fn


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
    return time.perf_counter() - t0


async def latency(direct: str, gateway: str, n: int, gw: psutil.Process) -> dict:
    body = json.dumps(CHAT).encode()
    conn = aiohttp.TCPConnector(limit=2)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(200):  # warm up both paths (connections, caches)
            await one(s, direct, body)
            await one(s, gateway, body)
        d, g = [], []
        cpu0 = cpu_s(gw)
        for _ in range(n):  # interleaved: noise from other processes hits both paths alike
            d.append(await one(s, direct, body))
            g.append(await one(s, gateway, body))
        cpu = cpu_s(gw) - cpu0
    return {"direct_p50_ms": pct(d, .5) * 1e3, "direct_p99_ms": pct(d, .99) * 1e3,
            "gateway_p50_ms": pct(g, .5) * 1e3, "gateway_p99_ms": pct(g, .99) * 1e3,
            "added_p50_ms": (pct(g, .5) - pct(d, .5)) * 1e3, "added_p99_ms": (pct(g, .99) - pct(d, .99)) * 1e3,
            "added_mean_ms": (statistics.fmean(g) - statistics.fmean(d)) * 1e3,
            "gateway_cpu_us_per_request": cpu / n * 1e6}


async def throughput(url: str, concurrency: int, seconds: float, procs: dict[str, psutil.Process]) -> dict:
    body = json.dumps(CHAT).encode()
    done = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(50):
            await one(s, url, body)
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one(s, url, body)
                done += 1
        cpu0 = {k: cpu_s(p) for k, p in procs.items()}
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    cpu = {k: cpu_s(p) - cpu0[k] for k, p in procs.items()}
    out = {"req_s": done / wall}
    for k, c in cpu.items():
        out[f"{k}_core_util"] = c / wall
        out[f"{k}_cpu_us_per_request"] = c / done * 1e6
    return out


async def stream(url: str, tokens: int) -> dict:
    body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        n = events = 0
        async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            async for chunk in r.content.iter_any():
                n += len(chunk)
                events += chunk.count(b"\n\n")
        wall = time.perf_counter() - t0
    return {"events_s": events / wall, "mb_s": n / wall / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per path in the latency phase")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0, help="per throughput run")
    ap.add_argument("--stream-tokens", type=int, default=20000)
    ap.add_argument("--gateway-cpu", type=int, default=0, help="the one core the gateway may use")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started, below

    others = (os.sched_getaffinity(0) - {args.gateway_cpu}) or {args.gateway_cpu}
    os.sched_setaffinity(0, others)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    pg = EmbeddedPostgres(tmp / "pg", free_port(), tmp / "postgres.log", durable=False)
    procs: list[subprocess.Popen] = []
    try:
        pg.start()
        upgrade(pg.url)
        eport, gport, aport, nport = (free_port() for _ in range(4))
        engine = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(eport),
                                   "--model", "bench", "--tokens-per-second", "0"], preexec_fn=pinned(others),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(engine)
        env = {**os.environ, "LLMGW_DATABASE_URL": pg.url, "LLMGW_STATE_DIR": str(tmp / "state"),
               "LLMGW_GATEWAY_PORT": str(gport), "LLMGW_ADMIN_PORT": str(aport), "LLMGW_NODE_API_PORT": str(nport),
               "LLMGW_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}  # nothing there: the gateway needs none
        with open(tmp / "server.log", "ab") as log:
            server = subprocess.Popen([sys.executable, "-m", "llmgw", "server", "--no-migrate"], env=env,
                                      preexec_fn=pinned({args.gateway_cpu}), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        procs.append(server)
        wait_port(eport, 30, engine, "sim engine")
        wait_port(aport, 60, server, "admin API")
        r = httpx.post(f"http://127.0.0.1:{aport}/admin/v1/catalog", timeout=30,
                       json={"catalog": {"models": [{"name": "bench", "endpoints": [f"http://127.0.0.1:{eport}"]}]}})
        r.raise_for_status()
        direct = f"http://127.0.0.1:{eport}/v1/chat/completions"
        gateway = f"http://127.0.0.1:{gport}/v1/chat/completions"
        deadline = time.monotonic() + 30
        while httpx.post(gateway, json=CHAT, timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway never routed `bench`; see " + str(tmp / "server.log"))
            time.sleep(0.2)
        gw, eng = psutil.Process(server.pid), psutil.Process(engine.pid)

        lat = asyncio.run(latency(direct, gateway, args.requests, gw))
        thr_d = asyncio.run(throughput(direct, args.concurrency, args.seconds, {"engine": eng}))
        thr_g = asyncio.run(throughput(gateway, args.concurrency, args.seconds, {"gateway": gw, "engine": eng}))
        st_d = asyncio.run(stream(direct, args.stream_tokens))
        st_g = asyncio.run(stream(gateway, args.stream_tokens))

        print(f"llmgw gateway overhead (sim engine, zero delay; gateway on cpu {args.gateway_cpu}, "
              f"engine + client on cpus {sorted(others)}; {os.cpu_count()} cpus)")
        print(f"latency, one request at a time ({args.requests} each, interleaved):")
        print(f"  direct   p50 {lat['direct_p50_ms']:.3f} ms  p99 {lat['direct_p99_ms']:.3f} ms")
        print(f"  gateway  p50 {lat['gateway_p50_ms']:.3f} ms  p99 {lat['gateway_p99_ms']:.3f} ms")
        print(f"  added    p50 {lat['added_p50_ms']:.3f} ms  p99 {lat['added_p99_ms']:.3f} ms  "
              f"mean {lat['added_mean_ms']:.3f} ms  (gateway/direct p50 {lat['gateway_p50_ms'] / lat['direct_p50_ms']:.2f}x)")
        print(f"  gateway CPU per request: {lat['gateway_cpu_us_per_request']:.0f} us "
              f"(= {1e6 / lat['gateway_cpu_us_per_request']:.0f} req/s per gateway core)")
        print(f"throughput, {args.concurrency} concurrent, {args.seconds:g}s each:")
        print(f"  direct   {thr_d['req_s']:.0f} req/s  (engine core {thr_d['engine_core_util']:.2f}, "
              f"engine CPU {thr_d['engine_cpu_us_per_request']:.0f} us/request)")
        print(f"  gateway  {thr_g['req_s']:.0f} req/s  (gateway/direct {thr_g['req_s'] / thr_d['req_s']:.2f}x; "
              f"gateway core {thr_g['gateway_core_util']:.2f}, engine core {thr_g['engine_core_util']:.2f})")
        print(f"  gateway CPU {thr_g['gateway_cpu_us_per_request']:.0f} us/request "
              f"= {1e6 / thr_g['gateway_cpu_us_per_request']:.0f} req/s per gateway core")
        print(f"streaming relay, one stream of {args.stream_tokens} tokens:")
        print(f"  direct   {st_d['events_s']:.0f} events/s  {st_d['mb_s']:.1f} MB/s")
        print(f"  gateway  {st_g['events_s']:.0f} events/s  {st_g['mb_s']:.1f} MB/s  "
              f"(gateway/direct {st_g['events_s'] / st_d['events_s']:.2f}x)")
    finally:
        for p in reversed(procs):
            stop_process(p, grace_s=5)
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
