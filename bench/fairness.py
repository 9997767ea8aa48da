"""Fair queues at saturation (issue 37): one model, a small concurrency limit, tenants that offer unequal
load, fair queuing against first come, first served (FIFO) in the same run.

One embedded PostgreSQL, one sim engine emitting `--tokens-per-second`, one real `llmgw server` routing
model `bench-slow` to it with `limits: {max_concurrency: --slots, max_queue: --queue}`. FIFO is the same
gateway with keys of no tenant: every such request waits in one shared flow, served in arrival order,
which is what the gate did before fair queues. Fair is keys of tenants `h`, `l` (and `a`, `b`), weight 1
each. Arrivals are Poisson (seeded), open loop; every request streams `max_tokens` tokens.

Phases (each `--seconds` long):
1. `L alone`: tenant L at `--light-rate` requests/s; its p99 TTFT is the baseline.
2. `H+L fair` and 3. `H+L FIFO`: L as in 1, and H offering 10x L's rate, together more than the model
   serves: L's p99 TTFT against 1 (target <= 1.5x), total throughput (tokens/s) fair against FIFO
   (target >= 0.92x), and what each tenant got (429s: refused by a full queue).
4. `A+B fair` and 5. `A+B FIFO`: two equal-weight tenants, both offering more than half of what the model
   serves, A asking `--tokens` per request and B 4x that: Jain's fairness index of their goodput in
   tokens/s (target >= 0.95): token-fair queuing gives each half, FIFO gives B four times A's tokens.

Run: `.venv/bin/python bench/fairness.py` (about two minutes); `--headroom 1` gives the model a slot of headroom
(docs/gateway.md, "Fair queues"), which is what takes L's TTFT under saturation near its TTFT alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp
import httpx

from common import Stack, pct


class Tally:
    """One tenant's requests in one phase: TTFTs of those served, when each token came, refusals."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.times: list[float] = []  # perf_counter() of each token received
        self.done = 0
        self.refused = 0
        self.failed = 0

    def tokens(self, start: float, end: float) -> int:
        return sum(1 for t in self.times if start <= t < end)


async def one(s: aiohttp.ClientSession, url: str, key: str, tokens: int, t: Tally) -> None:
    body = {"model": "bench-slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "stream": True}
    start = time.perf_counter()
    try:
        async with s.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
            if r.status in (429, 503):
                await r.read()
                t.refused += 1
                return
            if r.status != 200:
                await r.read()
                t.failed += 1
                return
            first = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    if b'"content"' in line:
                        t.times.append(now)
            if first is not None:
                t.ttft.append(first)
            t.done += 1
    except aiohttp.ClientError:
        t.failed += 1


async def offer(s: aiohttp.ClientSession, url: str, key: str, rate: float, tokens: int, seconds: float,
                t: Tally, rng: random.Random) -> None:
    """Poisson arrivals at `rate`/s for `seconds`, each a request of `tokens`; waits for all to end."""
    tasks = []
    end = time.perf_counter() + seconds
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.perf_counter() >= end:
            break
        tasks.append(asyncio.create_task(one(s, url, key, tokens, t)))
    await asyncio.gather(*tasks)


WARM_S = 2.0  # goodput is counted from this long after a phase starts (the queue has formed) to its end


async def phase(url: str, loads: dict[str, tuple[str, float, int]], seconds: float, seed: int) -> tuple[dict, tuple]:
    """Run tenants' loads together: name -> (key, rate, tokens). Returns their tallies and the window
    goodput is counted over (from `WARM_S` in to the end of arrivals, while the model is saturated)."""
    tallies = {n: Tally() for n in loads}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(offer(s, url, key, rate, tokens, seconds, tallies[n], random.Random(seed + i))
                               for i, (n, (key, rate, tokens)) in enumerate(loads.items())))
    return tallies, (t0 + min(WARM_S, seconds / 4), t0 + seconds)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def goodput(t: Tally, window: tuple[float, float]) -> float:
    return t.tokens(*window) / (window[1] - window[0])


def row(name: str, t: Tally, window: tuple[float, float]) -> str:
    p50 = pct(t.ttft, .5) * 1e3 if t.ttft else float("nan")
    p99 = pct(t.ttft, .99) * 1e3 if t.ttft else float("nan")
    return (f"  {name:<3} served {t.done:4d}  refused {t.refused:4d}  failed {t.failed:3d}  "
            f"TTFT p50 {p50:8.1f} ms  p99 {p99:8.1f} ms  goodput {goodput(t, window):7.1f} tokens/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=8, help="the model's limits.max_concurrency")
    p.add_argument("--queue", type=int, default=64, help="the model's limits.max_queue")
    p.add_argument("--headroom", type=int, default=0, help="the model's limits.headroom")
    p.add_argument("--tokens-per-second", type=float, default=50.0, help="the sim engine's speed per stream")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request (B's: 4x)")
    p.add_argument("--light-rate", type=float, default=3.0, help="L's requests per second (H: 10x)")
    p.add_argument("--seconds", type=float, default=20.0, help="each phase's arrivals")
    p.add_argument("--gateway-cpu", type=int, default=0)
    args = p.parse_args()
    n, seconds = args.tokens, args.seconds
    service_s = n / args.tokens_per_second
    capacity = args.slots / service_s  # requests of n tokens per second
    tokens_s = args.slots * args.tokens_per_second  # what the model streams at saturation, tokens/s
    heavy = 10 * args.light_rate
    rate_a, rate_b = 0.75 * tokens_s / n, 3 * tokens_s / (4 * n)
    print(f"model: {args.slots} slots (+{args.headroom} headroom), queue {args.queue}, {n} tokens per request at {args.tokens_per_second:g} "
          f"tokens/s ({service_s * 1e3:.0f} ms each): serves {capacity:.1f} requests/s, {tokens_s:.0f} tokens/s")
    print(f"offered: L {args.light_rate:g}/s, H {heavy:g}/s of {n} tokens (together {(heavy + args.light_rate) / capacity:.2f}x "
          f"what it serves); A {rate_a:.1f}/s of {n} tokens (0.75x), B {rate_b:.1f}/s of {4 * n} tokens (3x)")
    with Stack(args.gateway_cpu, slow_tokens_per_second=args.tokens_per_second) as st:
        admin = httpx.Client(base_url=st.admin, headers=st.admin_headers, timeout=30)
        r = admin.post("/admin/v1/catalog", json={"catalog": {"models": [
            {"name": "bench", "endpoints": [st.direct.rsplit("/v1/", 1)[0]]},
            {"name": "bench-slow", "endpoints": [st.direct_slow.rsplit("/v1/", 1)[0]],
             "limits": {"max_concurrency": args.slots, "max_queue": args.queue, "queue_timeout_s": 60,
                        "headroom": args.headroom}}]}})
        r.raise_for_status()
        keys: dict[str, str] = {}
        for name in ("h", "l", "a", "b"):
            admin.post("/admin/v1/tenants", json={"name": name, "limits": {"weight": 1}}).raise_for_status()
            keys[name] = admin.post("/admin/v1/keys", json={"name": name, "tenant": name}).json()["key"]
            keys["fifo-" + name] = admin.post("/admin/v1/keys", json={"name": "fifo-" + name}).json()["key"]
        url = st.gateway
        deadline = time.monotonic() + 30
        while True:  # the keys and the limits have reached the gateway
            ok = httpx.post(url, timeout=10, headers={"authorization": f"Bearer {keys['b']}"},
                            json={"model": "bench-slow", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 1}).status_code == 200
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        alone = asyncio.run(phase(url, {"L": (keys["l"], args.light_rate, n)}, seconds, 1))
        mixed, pair = {}, {}
        for mode, pre in (("fair", ""), ("FIFO", "fifo-")):
            mixed[mode] = asyncio.run(phase(url, {"L": (keys[pre + "l"], args.light_rate, n),
                                                  "H": (keys[pre + "h"], heavy, n)}, seconds, 1))
        for mode, pre in (("fair", ""), ("FIFO", "fifo-")):
            pair[mode] = asyncio.run(phase(url, {"A": (keys[pre + "a"], rate_a, n),
                                                 "B": (keys[pre + "b"], rate_b, 4 * n)}, seconds, 2))

    print(f"\n1. L alone ({seconds:g} s of arrivals)")
    print(row("L", alone[0]["L"], alone[1]))
    for title, runs in (("H+L", mixed), ("A+B", pair)):
        for mode, (tallies, window) in runs.items():
            print(f"\n{title} {mode} ({seconds:g} s of arrivals; goodput over the last {window[1] - window[0]:.0f} s)")
            for name, t in tallies.items():
                print(row(name, t, window))

    base = pct(alone[0]["L"].ttft, .99)
    ratio = {m: pct(mixed[m][0]["L"].ttft, .99) / base for m in mixed}
    median = {m: pct(mixed[m][0]["L"].ttft, .5) / pct(alone[0]["L"].ttft, .5) for m in mixed}
    total = {m: sum(goodput(t, w) for t in ts.values()) for m, (ts, w) in mixed.items()}
    total_pair = {m: sum(goodput(t, w) for t in ts.values()) for m, (ts, w) in pair.items()}
    fairness = {m: jain([goodput(t, w) for t in ts.values()]) for m, (ts, w) in pair.items()}
    t_ratio = min(total["fair"] / total["FIFO"], total_pair["fair"] / total_pair["FIFO"])
    print("\nfigures:")
    print(f"  L p99 TTFT with H / alone: fair {ratio['fair']:.2f}x, FIFO {ratio['FIFO']:.2f}x   (target <= 1.5x: "
          f"{'met' if ratio['fair'] <= 1.5 else 'NOT met'}; p50: fair {median['fair']:.2f}x, FIFO {median['FIFO']:.2f}x)")
    print(f"  Jain's index of A's and B's goodput (tokens/s): fair {fairness['fair']:.3f}, FIFO {fairness['FIFO']:.3f}   "
          f"(target >= 0.95: {'met' if fairness['fair'] >= 0.95 else 'NOT met'})")
    print(f"  throughput fair / FIFO: H+L {total['fair']:.0f} / {total['FIFO']:.0f} tokens/s = "
          f"{total['fair'] / total['FIFO']:.3f}x, A+B {total_pair['fair']:.0f} / {total_pair['FIFO']:.0f} = "
          f"{total_pair['fair'] / total_pair['FIFO']:.3f}x   (target >= 0.92x: {'met' if t_ratio >= 0.92 else 'NOT met'})")
    print(json.dumps({"l_p99_ttft_ratio": ratio, "jain": fairness, "throughput_ratio": t_ratio}))


if __name__ == "__main__":
    main()
