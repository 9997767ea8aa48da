"""Prefix-aware balancing against least outstanding, on sim engines that model a prefix cache (issue 37).

What it starts (common.Stack): an embedded PostgreSQL and a real `llmgw server` (pinned to `--gateway-cpu`),
and eight sim engines with a prefix cache of `--cache-blocks` blocks of 16 tokens and a prefill time
(`--prefill-tokens-per-second`, one prefill at a time per engine: engines/sim_cache.py). Two models of four
replicas each: `lo` (least outstanding, the default) and `px` (`balancing: prefix`).

The workload, the same for both and run on both at once (so both see the same machine): `--clients`
closed-loop clients per model, each sending streamed chats one after another for `--seconds`; each chat
has one of `--prompts` shared system prompts of `--system-words` words (chosen uniformly) and a short user
message of its own. The system prompts together are about two and a half times what one replica's cache
holds, and less than four hold: least outstanding sends each prompt to any replica, so every cache churns through all
of them; prefix-aware sends each prompt's requests to one replica (within the load bound), so each cache
holds a quarter of them.

What it prints: per model, requests completed and per second, time to first token p50/p99, the share of
prompt tokens the engines found cached (their `/metrics`), and the ratios px / lo. The first
`--warmup` seconds are not counted (requests that began in them, and cache counts). Run: `.venv/bin/python bench/prefix.py` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp
import httpx

from common import Stack, pct

MODELS = ("lo", "px")


class Tally:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.done = 0
        self.failed = 0


async def client(s: aiohttp.ClientSession, url: str, model: str, prompts: list[str], rng: random.Random,
                 until: float, counted_from: float, tally: Tally) -> None:
    while time.perf_counter() < until:
        user = " ".join(f"u{rng.randrange(10**9)}" for _ in range(12))
        body = {"model": model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "system", "content": rng.choice(prompts)}, {"role": "user", "content": user}]}
        t0 = time.perf_counter()
        ttft = None
        try:
            async with s.post(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    tally.failed += 1
                    await r.read()
                    continue
                async for chunk in r.content.iter_any():
                    if ttft is None and b"data: {" in chunk:
                        ttft = time.perf_counter() - t0
        except aiohttp.ClientError:
            tally.failed += 1
            continue
        if t0 >= counted_from and ttft is not None:
            tally.ttft.append(ttft)
            tally.done += 1


def cache_counts(urls: list[str]) -> tuple[int, int]:
    queries = hits = 0
    for u in urls:
        for ln in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if ln.startswith("sim:prefix_cache_queries_total"):
                queries += int(ln.split()[1])
            elif ln.startswith("sim:prefix_cache_hits_total"):
                hits += int(ln.split()[1])
    return queries, hits


async def run(args: argparse.Namespace, stack: Stack) -> dict:
    from llmgw.dev.procs import free_port, wait_port

    engines: dict[str, list[str]] = {}
    for m in MODELS:
        urls = []
        for i in range(args.replicas):
            port = free_port()
            p = stack.spawn([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(port), "--model", m,
                             "--tokens-per-second", str(args.tokens_per_second),
                             "--prefix-cache-blocks", str(args.cache_blocks),
                             "--prefill-tokens-per-second", str(args.prefill_tokens_per_second)],
                            stack.others, log=f"{m}-{i}")
            wait_port(port, 30, p, f"sim engine {m}-{i}")
            urls.append(f"http://127.0.0.1:{port}")
        engines[m] = urls
    catalog = {"models": [{"name": "bench", "endpoints": [stack.direct.removesuffix("/v1/chat/completions")]},
                          {"name": "lo", "endpoints": engines["lo"]},
                          {"name": "px", "endpoints": engines["px"], "balancing": "prefix"}]}
    httpx.post(stack.admin + "/admin/v1/catalog", timeout=30, headers=stack.admin_headers,
               json={"catalog": catalog}).raise_for_status()
    for m in MODELS:  # until the gateway routes both
        deadline = time.monotonic() + 30
        while httpx.post(stack.gateway, timeout=10, json={"model": m, "messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 1}).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway never routed {m}")
            time.sleep(0.2)
    rng = random.Random(args.seed)
    prompts = [" ".join(f"p{k}w{rng.randrange(10**9)}" for _ in range(args.system_words)) for k in range(args.prompts)]
    tallies = {m: Tally() for m in MODELS}
    start = time.perf_counter()
    counted_from, until = start + args.warmup, start + args.warmup + args.seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        clients = asyncio.gather(*(client(s, stack.gateway, m, prompts, random.Random(args.seed * 1000 + i + 500 * j),
                                          until, counted_from, tallies[m])
                                   for j, m in enumerate(MODELS) for i in range(args.clients)))
        await asyncio.sleep(args.warmup)
        before = {m: await asyncio.to_thread(cache_counts, engines[m]) for m in MODELS}
        await clients
    out = {}
    for m in MODELS:
        q0, h0 = before[m]
        q1, h1 = cache_counts(engines[m])
        t = tallies[m]
        out[m] = {"requests": t.done, "failed": t.failed, "per_s": t.done / args.seconds,
                  "ttft_p50_ms": pct(t.ttft, 0.5) * 1000, "ttft_p99_ms": pct(t.ttft, 0.99) * 1000,
                  "cached_share": (h1 - h0) / max(1, q1 - q0)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway-cpu", type=int, default=0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients per model")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--prompts", type=int, default=16, help="shared system prompts")
    p.add_argument("--system-words", type=int, default=1000, help="words (sim tokens) of each system prompt")
    p.add_argument("--cache-blocks", type=int, default=400, help="each engine's cache: about 6 system prompts")
    p.add_argument("--prefill-tokens-per-second", type=float, default=5000.0)
    p.add_argument("--tokens-per-second", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    with Stack(args.gateway_cpu) as stack:
        res = asyncio.run(run(args, stack))
    for m in MODELS:
        r = res[m]
        print(f"{m}: {r['requests']} requests ({r['failed']} failed), {r['per_s']:.1f}/s, TTFT p50 "
              f"{r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, prompt tokens cached {r['cached_share']:.0%}")
    lo, px = res["lo"], res["px"]
    print(f"px / lo: throughput {px['per_s'] / lo['per_s']:.2f}x, TTFT p50 {px['ttft_p50_ms'] / lo['ttft_p50_ms']:.2f}x, "
          f"p99 {px['ttft_p99_ms'] / lo['ttft_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
