"""Two gateways side by side, this tree's and a baseline's, measured in the same minutes: A/B overhead.

On a shared machine one run after another is not a comparison (the load changes between them by more
than the difference looked for). So this starts one embedded PostgreSQL, one sim engine (no token delay)
and two `llmgw server` processes on the same core, `A` from `--baseline-src` (a `src/` directory of an
older llmgw, for example `git archive <commit> | tar -x -C /tmp/base`) and `B` from this tree, routing the
same catalog, and alternates between them request by request (latency) or segment by segment (throughput,
streaming). Each figure of B is printed next to A's from the same minutes.

Streaming is measured two ways. Bulk: one stream at a time from an engine with no token delay; the relay
then reads many events per read, and how many depends on the load on the other core, so its CPU per event
varies from one stream to the next by more than the difference looked for: several alternating pairs are
run and the median of their B/A ratios printed beside the total. Paced: many concurrent streams from a
second engine that writes each stream's tokens `1/--paced-rate` s apart, so that nearly every event is a
read and a write of its own, as with real engines; this is the relay's full cost per event, and steadier.

Run: `.venv/bin/python bench/ab.py --baseline-src /tmp/base/src` (about three minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from common import CHAT, cpu_s, one, pct, pinned


async def latency(urls: dict[str, str], procs: dict[str, psutil.Process], n: int) -> dict:
    body = json.dumps(CHAT).encode()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=3)) as s:
        for _ in range(200):
            for u in urls.values():
                await one(s, u, body)
        times: dict[str, list[float]] = {k: [] for k in urls}
        cpu0 = {k: cpu_s(p) for k, p in procs.items()}
        order = list(urls.items())
        for i in range(n):  # direct, A, B, then B, A, direct: whoever goes first is not favoured
            for k, u in (order if i % 2 == 0 else order[::-1]):
                times[k].append(await one(s, u, body))
        cpu = {k: (cpu_s(p) - cpu0[k]) / n * 1e6 for k, p in procs.items()}
    return {k: {"p50": pct(v, .5) * 1e3, "p99": pct(v, .99) * 1e3, "cpu_us": cpu.get(k)} for k, v in times.items()}


async def throughput(url: str, proc: psutil.Process, concurrency: int, seconds: float) -> tuple[int, float]:
    body = json.dumps(CHAT).encode()
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        stop_at = time.perf_counter() + seconds
        cpu0 = cpu_s(proc)

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one(s, url, body)
                done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, cpu_s(proc) - cpu0


async def paced(url: str, proc: psutil.Process, streams: int, tokens: int) -> tuple[int, float]:
    """`streams` concurrent streams of `tokens` tokens from the paced engine: (events, relay CPU s)."""
    body = json.dumps({**CHAT, "model": "paced", "max_tokens": tokens, "stream": True}).encode()
    events = 0

    async def one_stream(s: aiohttp.ClientSession) -> None:
        nonlocal events
        async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            async for chunk in r.content.iter_any():
                events += chunk.count(b"\n\n")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as s:
        await one(s, url, json.dumps({**CHAT, "model": "paced", "max_tokens": 1}).encode())  # connections warm
        cpu0 = cpu_s(proc)
        await asyncio.gather(*(one_stream(s) for _ in range(streams)))
    return events, cpu_s(proc) - cpu0


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:len(xs) // 2 + 1]) / 2


async def stream(url: str, proc: psutil.Process, tokens: int) -> tuple[int, float]:
    body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
    events = 0
    cpu0 = cpu_s(proc)
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            async for chunk in r.content.iter_any():
                events += chunk.count(b"\n\n")
    return events, cpu_s(proc) - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", required=True, help="the `src` directory of the baseline llmgw")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=2.0, help="per throughput segment")
    ap.add_argument("--segments", type=int, default=8, help="throughput segments per gateway, alternating")
    ap.add_argument("--stream-tokens", type=int, default=20000)
    ap.add_argument("--stream-pairs", type=int, default=4, help="bulk streams per gateway, alternating")
    ap.add_argument("--paced-streams", type=int, default=50, help="concurrent streams in a paced segment")
    ap.add_argument("--paced-rate", type=float, default=100.0, help="tokens per second of each paced stream")
    ap.add_argument("--paced-tokens", type=int, default=300, help="tokens per paced stream")
    ap.add_argument("--paced-segments", type=int, default=4, help="paced segments per gateway, alternating")
    ap.add_argument("--gateway-cpu", type=int, default=0)
    ap.add_argument("--limits", type=json.loads, default=None,
                    help='the catalog `limits` of model `bench`, as JSON: `{"max_concurrency": 64}` measures the '
                         "concurrency gate's path with a free slot")
    args = ap.parse_args()

    import httpx

    from llmgw.db.migrate import upgrade
    from llmgw.dev.postgres import EmbeddedPostgres
    from llmgw.dev.procs import free_port, stop_process, wait_port

    here = Path(__file__).resolve().parent.parent / "src"
    gcpu = {args.gateway_cpu}
    others = (os.sched_getaffinity(0) - gcpu) or gcpu
    os.sched_setaffinity(0, others)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-ab-"))
    procs: list[subprocess.Popen] = []
    pg = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def spawn(argv: list[str], cpus: set[int], env: dict, log: str) -> subprocess.Popen:
        with open(tmp / f"{log}.log", "ab") as out:
            p = subprocess.Popen(argv, env=env, preexec_fn=pinned(cpus), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append(p)
        return p

    try:
        pg = EmbeddedPostgres(tmp / "pg", free_port(), tmp / "postgres.log", durable=False)
        pg.start()
        upgrade(pg.url)
        eport = free_port()
        engine = spawn([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(eport), "--model", "bench",
                        "--tokens-per-second", "0"], others, dict(os.environ), "engine")
        wait_port(eport, 30, engine, "sim engine")
        pport = free_port()
        pacer = spawn([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(pport), "--model", "paced",
                       "--tokens-per-second", str(args.paced_rate)], others, dict(os.environ), "paced-engine")
        wait_port(pport, 30, pacer, "paced sim engine")
        urls, gw = {}, {}
        token = "llmgw-admin-" + secrets.token_urlsafe(32)  # the admin API wants it, on loopback too
        for name, src in (("A", str(Path(args.baseline_src).resolve())), ("B", str(here))):
            g, a, n = free_port(), free_port(), free_port()
            env = {**os.environ, "PYTHONPATH": src, "LLMGW_DATABASE_URL": pg.url,
                   "LLMGW_STATE_DIR": str(tmp / f"state-{name}"), "LLMGW_GATEWAY_PORT": str(g),
                   "LLMGW_ADMIN_PORT": str(a), "LLMGW_NODE_API_PORT": str(n), "LLMGW_ADMIN_TOKEN": token,
                   "LLMGW_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}
            p = spawn([sys.executable, "-m", "llmgw", "server", "--no-migrate"], gcpu, env, f"server-{name}")
            wait_port(a, 60, p, f"admin API {name}")
            wait_port(g, 60, p, f"gateway {name}")
            urls[name] = f"http://127.0.0.1:{g}/v1/chat/completions"
            gw[name] = psutil.Process(p.pid)
            admin = f"http://127.0.0.1:{a}"
        httpx.post(admin + "/admin/v1/catalog", timeout=30, headers={"authorization": f"Bearer {token}"}, json={"catalog": {"models": [
            {"name": "bench", "endpoints": [f"http://127.0.0.1:{eport}"], **({"limits": args.limits} if args.limits else {})},
            {"name": "paced", "endpoints": [f"http://127.0.0.1:{pport}"]}]}}).raise_for_status()
        deadline = time.monotonic() + 30
        while any(httpx.post(u, json=CHAT, timeout=10).status_code != 200 for u in urls.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"a gateway never routed `bench`; see {tmp}")
            time.sleep(0.2)

        lat = asyncio.run(latency({"direct": f"http://127.0.0.1:{eport}/v1/chat/completions", **urls}, gw,
                                  args.requests))
        thr = {k: [0, 0.0] for k in urls}
        for i in range(args.segments):  # A B B A A B ...
            for k in (("A", "B") if i % 2 == 0 else ("B", "A")):
                done, cpu = asyncio.run(throughput(urls[k], gw[k], args.concurrency, args.seconds))
                thr[k][0] += done
                thr[k][1] += cpu
        st = {k: [0, 0.0] for k in urls}
        pairs: list[float] = []  # B/A per event of each alternating pair
        for i in range(args.stream_pairs):
            per = {}
            for k in (("A", "B") if i % 2 == 0 else ("B", "A")):
                ev, cpu = asyncio.run(stream(urls[k], gw[k], args.stream_tokens))
                st[k][0] += ev
                st[k][1] += cpu
                per[k] = cpu / ev
            pairs.append(per["B"] / per["A"])
        pc = {k: [0, 0.0] for k in urls}
        paced_pairs: list[float] = []
        for i in range(args.paced_segments):
            per = {}
            for k in (("A", "B") if i % 2 == 0 else ("B", "A")):
                ev, cpu = asyncio.run(paced(urls[k], gw[k], args.paced_streams, args.paced_tokens))
                pc[k][0] += ev
                pc[k][1] += cpu
                per[k] = cpu / ev
            paced_pairs.append(per["B"] / per["A"])
    finally:
        for p in reversed(procs):
            stop_process(p, grace_s=5)
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"A = {args.baseline_src}, B = this tree; both gateways on cpu {args.gateway_cpu}; "
          f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    d = lat["direct"]
    print(f"latency, one request at a time, {args.requests} each, interleaved direct/A/B and B/A/direct:")
    print(f"  direct  p50 {d['p50']:.3f} ms  p99 {d['p99']:.3f} ms")
    for k in urls:
        v = lat[k]
        print(f"  {k}       p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms  added p50 {v['p50'] - d['p50']:.3f} ms  "
              f"p99 {v['p99'] - d['p99']:.3f} ms  CPU {v['cpu_us']:.0f} us/request")
    print(f"throughput, {args.concurrency} concurrent, {args.segments} alternating segments of {args.seconds:g}s each:")
    for k in urls:
        done, cpu = thr[k]
        print(f"  {k}  {done / (args.segments * args.seconds):.0f} req/s  CPU {cpu / done * 1e6:.0f} us/request "
              f"= {done / cpu:.0f} req/s per gateway core")
    print(f"streaming, bulk: {args.stream_pairs} alternating streams of {args.stream_tokens} tokens each per gateway:")
    for k in urls:
        ev, cpu = st[k]
        print(f"  {k}  CPU {cpu / ev * 1e6:.1f} us/event")
    print(f"  B/A of each pair: {' '.join(f'{r:.3f}' for r in pairs)}")
    print(f"streaming, paced: {args.paced_segments} alternating segments per gateway of {args.paced_streams} concurrent "
          f"streams of {args.paced_tokens} tokens at {args.paced_rate:g} tokens/s:")
    for k in urls:
        ev, cpu = pc[k]
        print(f"  {k}  {ev} events  CPU {cpu / ev * 1e6:.1f} us/event")
    print(f"  B/A of each pair: {' '.join(f'{r:.3f}' for r in paced_pairs)}")
    a, b = thr["A"], thr["B"]
    print(f"B/A: CPU per request at c=1 {lat['B']['cpu_us'] / lat['A']['cpu_us']:.3f}, at c={args.concurrency} "
          f"{(b[1] / b[0]) / (a[1] / a[0]):.3f}; per event, bulk {(st['B'][1] / st['B'][0]) / (st['A'][1] / st['A'][0]):.3f} "
          f"(median of pairs {median(pairs):.3f}), paced {(pc['B'][1] / pc['B'][0]) / (pc['A'][1] / pc['A'][0]):.3f} "
          f"(median of pairs {median(paced_pairs):.3f})")


if __name__ == "__main__":
    main()
