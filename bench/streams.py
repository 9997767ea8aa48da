"""Many concurrent streams through one gateway process: completeness, memory per open stream, added TTFT.

What it starts (common.Stack): an embedded PostgreSQL, two sim engines and a real `llmgw server` (pinned
to `--gateway-cpu`): `bench-slow` emits `--tokens-per-second` tokens per second (the long streams), and
`bench` has no token delay (the probes).

What it does, each phase against the engine directly and then through the gateway, in the same run:
1. opens `--streams` streams of `--tokens` tokens on `bench-slow` at once (with the default 1,000 x 40
   tokens at 2 tokens/s, each stream stays open about 20 s);
2. once every stream has its first token, samples the gateway's resident memory (and, through the
   gateway, subtracts its idle figure taken just before) and, while all of them are open, sends
   `--probes` short streams to `bench`, one at a time, direct and through the gateway alternately;
3. waits for every stream to end and checks each: all its tokens, then exactly one `data: [DONE]`.

What it prints: streams complete (must be all), the burst's time to first token (p50/p99, direct and
through the gateway), the probes' time to first token at that concurrency and what the gateway adds, and
the gateway's memory per open stream. Run: `.venv/bin/python bench/streams.py` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time

import aiohttp

from common import CHAT, Stack, pct


class Tally:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.complete = 0
        self.broken: list[str] = []
        self.first = 0


async def one_stream(s: aiohttp.ClientSession, url: str, model: str, tokens: int, tally: Tally,
                     all_started: asyncio.Event, total: int) -> None:
    body = json.dumps({**CHAT, "model": model, "max_tokens": tokens, "stream": True}).encode()
    t0 = time.perf_counter()
    got = done = 0
    buf = b""
    try:
        async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                tally.broken.append(f"HTTP {r.status}")
                return
            async for chunk in r.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for e in events:
                    if e == b"data: [DONE]":
                        done += 1
                    elif e.startswith(b"data: {"):
                        if got == 0:
                            tally.ttft.append(time.perf_counter() - t0)
                            tally.first += 1
                            if tally.first == total:
                                all_started.set()
                        got += 1
    except aiohttp.ClientError as exc:
        tally.broken.append(repr(exc))
        return
    if got == tokens and done == 1 and not buf:
        tally.complete += 1
    else:
        tally.broken.append(f"{got} tokens, {done} [DONE], {len(buf)} bytes left over")


async def probe(s: aiohttp.ClientSession, url: str) -> float:
    body = json.dumps({**CHAT, "max_tokens": 4, "stream": True}).encode()
    t0 = time.perf_counter()
    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.content.readuntil(b"data: {")
        ttft = time.perf_counter() - t0
        await r.read()
    return ttft


async def phase(st: Stack, via_gateway: bool, n: int, tokens: int, probes: int) -> dict:
    url = st.gateway if via_gateway else st.direct_slow
    gw = st.gateway_proc
    tally = Tally()
    all_started = asyncio.Event()
    out: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as ps:
        for _ in range(20):  # warm both probe paths
            await probe(ps, st.direct)
            await probe(ps, st.gateway)
        rss_idle = gw.memory_info().rss
        tasks = [asyncio.create_task(one_stream(s, url, "bench-slow", tokens, tally, all_started, n)) for _ in range(n)]
        try:
            await asyncio.wait_for(all_started.wait(), 120)
        except asyncio.TimeoutError:
            pass
        out["rss_idle"], out["rss_open"] = rss_idle, gw.memory_info().rss
        out["open_at_sample"] = tally.first
        direct_ttft, gateway_ttft = [], []
        for _ in range(probes):  # at that concurrency, interleaved
            direct_ttft.append(await probe(ps, st.direct))
            gateway_ttft.append(await probe(ps, st.gateway))
        out["all_open_during_probes"] = sum(1 for t in tasks if not t.done()) == n
        await asyncio.gather(*tasks)
    out.update(tally=tally, probe_direct=direct_ttft, probe_gateway=gateway_ttft)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per long stream")
    ap.add_argument("--tokens-per-second", type=float, default=2.0, help="of the long streams' engine")
    ap.add_argument("--probes", type=int, default=200, help="short streams per path while all are open")
    ap.add_argument("--gateway-cpu", type=int, default=0, help="the one core the gateway may use")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds a socket per stream

    with Stack(args.gateway_cpu, slow_tokens_per_second=args.tokens_per_second) as st:
        direct = asyncio.run(phase(st, False, args.streams, args.tokens, 0))
        through = asyncio.run(phase(st, True, args.streams, args.tokens, args.probes))

    def ms(xs: list[float], q: float) -> float:
        return pct(xs, q) * 1e3 if xs else float("nan")

    n = args.streams
    print(f"llmgw gateway, {n} concurrent streams (sim engine at {args.tokens_per_second:g} tokens/s, "
          f"{args.tokens} tokens each; gateway on cpu {args.gateway_cpu}; {os.cpu_count()} cpus)")
    for name, r in (("direct", direct), ("gateway", through)):
        t = r["tally"]
        print(f"  {name:8s} complete {t.complete}/{n}" + (f"  BROKEN {len(t.broken)}: {t.broken[:3]}" if t.broken else ""))
    print(f"time to first token of the {n} streams opened at once:")
    for name, r in (("direct", direct), ("gateway", through)):
        print(f"  {name:8s} p50 {ms(r['tally'].ttft, .5):8.1f} ms  p99 {ms(r['tally'].ttft, .99):8.1f} ms")
    d, g = through["probe_direct"], through["probe_gateway"]
    print(f"time to first token of {len(d)} short streams each way while the {n} streams are open through the "
          f"gateway (all open throughout: {through['all_open_during_probes']}):")
    print(f"  direct   p50 {ms(d, .5):.2f} ms  p99 {ms(d, .99):.2f} ms")
    print(f"  gateway  p50 {ms(g, .5):.2f} ms  p99 {ms(g, .99):.2f} ms")
    print(f"  added    p50 {ms(g, .5) - ms(d, .5):.2f} ms  p99 {ms(g, .99) - ms(d, .99):.2f} ms")
    grown = through["rss_open"] - through["rss_idle"]
    print(f"gateway memory: {through['rss_idle'] / 2**20:.1f} MiB idle, {through['rss_open'] / 2**20:.1f} MiB with "
          f"{through['open_at_sample']} streams open = {grown / max(1, through['open_at_sample']) / 1024:.1f} KiB "
          f"per open stream")


if __name__ == "__main__":
    main()
