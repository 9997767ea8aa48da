"""Gateway overhead against the sim engine, measured in one run: direct-to-engine vs through the gateway.

What it starts (common.Stack): an embedded PostgreSQL (the gateway's route table), the sim engine with no
token delay (`--tokens-per-second 0`) and a real `llmgw server` whose catalog routes the model `bench` to
that engine as a static endpoint. The gateway is pinned to one core (`--gateway-cpu`), the engine and this
load generator to the others, so "per gateway core" means what it says.

What it prints (every gateway figure next to the direct one measured in the same run):
- latency at one request at a time, interleaved direct/gateway: p50 and p99, and what the gateway adds;
- gateway CPU time per request (user + system of the gateway process, over the same requests);
- throughput at `--concurrency` for `--seconds`: req/s direct and through the gateway, each process's core
  utilisation, and req/s per gateway core (requests / gateway CPU seconds), which is the rate one core
  sustains even when the engine or this client is the bottleneck;
- streaming relay: SSE events/s and MB/s of one long stream, direct and through the gateway;
- the sim engine alone: its own CPU time per request (it may be the bottleneck, not the gateway);
- keys and limits (issue 15), last, on the same gateway: requests with a key of no tenant (`plain`: not
  accounted, the path every keyed deployment had) and with a key of a tenant with every kind of limit
  (`limited`: rpm, tpm, day and month budgets, model patterns; admitted, counted, usage read from each
  answer, the stream's usage asked for and stripped), alternating block by block at one request at a
  time, segment by segment at `--concurrency`, and in paced streams (`--paced-streams` concurrent streams
  from a second sim engine at `--paced-rate` tokens/s, so each event is a read and a write of its own);
  and the gateway's idle CPU with no accounted key and with one (the usage sync each second). The ratio
  limited/plain is printed; the target is within 1.10.

Run: `.venv/bin/python bench/overhead.py` (about two minutes). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import aiohttp
import httpx

from common import CHAT, Stack, cpu_exact_s, latency, one, pct, stream, throughput

# Every kind of limit, none of them reached by the bench.
LIMITS = {"rpm": 10_000_000, "tpm": 100_000_000_000, "tokens_per_day": 10**15, "tokens_per_month": 10**15,
          "models": ["bench*"]}


def make_keys(admin: str, gateway: str, same: bool = False, limits: dict | None = None,
              admin_headers: dict | None = None) -> dict[str, dict]:
    """A key of no tenant and a key of a tenant with `limits` (default `LIMITS`); the headers of each. With
    `same`, the second is a key of no tenant too: the method's own bias (the ratio it prints should be 1)."""
    def post(path: str, body: dict) -> dict:
        r = httpx.post(admin + path, json=body, timeout=30, headers=admin_headers)
        r.raise_for_status()
        return r.json()

    plain = post("/admin/v1/keys", {"name": "plain"})["key"]
    post("/admin/v1/tenants", {"name": "bench", "limits": LIMITS if limits is None else limits})
    limited = post("/admin/v1/keys", {"name": "limited", "tenant": None if same else "bench"})["key"]
    kinds = {"plain": {"Authorization": f"Bearer {plain}"}, "limited": {"Authorization": f"Bearer {limited}"}}
    deadline = time.monotonic() + 30
    for h in kinds.values():
        while httpx.post(gateway, json=CHAT, headers=h, timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway never took the bench's keys")
            time.sleep(0.1)
    return kinds


async def keyed_latency(url: str, kinds: dict[str, dict], blocks: int, block: int, gw) -> dict:
    """One request at a time, `block` of one kind then `block` of the other (the order flipped each time);
    the gateway's CPU measured per block (from the scheduler's nanosecond counters)."""
    body = json.dumps(CHAT).encode()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu = {k: 0.0 for k in kinds}
    pairs: list[float] = []  # limited/plain CPU of each pair of blocks
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as s:
        for h in kinds.values():
            for _ in range(200):
                await one(s, url, body, h)
        order = list(kinds.items())
        for b in range(blocks):
            this = {}
            for k, h in (order if b % 2 == 0 else order[::-1]):
                c0 = cpu_exact_s(gw)
                for _ in range(block):
                    times[k].append(await one(s, url, body, h))
                this[k] = cpu_exact_s(gw) - c0
                cpu[k] += this[k]
            pairs.append(this["limited"] / this["plain"])
    n = blocks * block
    out = {k: {"p50": pct(v, .5) * 1e3, "p99": pct(v, .99) * 1e3, "cpu_us": cpu[k] / n * 1e6} for k, v in times.items()}
    out["pairs"] = pairs  # type: ignore[assignment]
    return out


async def keyed_throughput(url: str, headers: dict, gw, concurrency: int, seconds: float) -> tuple[int, float]:
    body = json.dumps(CHAT).encode()
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        stop_at = time.perf_counter() + seconds
        c0 = cpu_exact_s(gw)

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one(s, url, body, headers)
                done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, cpu_exact_s(gw) - c0


async def keyed_paced(url: str, headers: dict, gw, streams: int, tokens: int) -> tuple[int, float]:
    """`streams` concurrent streams of `tokens` from the paced engine (`bench-slow`): (events, CPU s)."""
    body = json.dumps({**CHAT, "model": "bench-slow", "max_tokens": tokens, "stream": True}).encode()
    events = 0

    async def one_stream(s: aiohttp.ClientSession) -> None:
        nonlocal events
        async with s.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
            async for chunk in r.content.iter_any():
                events += chunk.count(b"\n\n")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as s:
        await one(s, url, json.dumps({**CHAT, "model": "bench-slow", "max_tokens": 1}).encode(), headers)
        c0 = cpu_exact_s(gw)
        await asyncio.gather(*(one_stream(s) for _ in range(streams)))
    return events, cpu_exact_s(gw) - c0


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if len(ys) % 2 else (ys[len(ys) // 2 - 1] + ys[len(ys) // 2]) / 2


def idle_cpu_ms_per_s(gw, seconds: float = 4.0) -> float:
    c0 = cpu_exact_s(gw)
    time.sleep(seconds)
    return (cpu_exact_s(gw) - c0) / seconds * 1e3


def keys_and_limits(st: Stack, args) -> dict:
    gw = st.gateway_proc
    idle_before = idle_cpu_ms_per_s(gw)
    kinds = make_keys(st.admin, st.gateway, args.same, json.loads(args.limits) if args.limits else None,
                      st.admin_headers)
    idle_after = idle_cpu_ms_per_s(gw)
    lat = asyncio.run(keyed_latency(st.gateway, kinds, args.key_blocks, args.key_block, gw))
    thr = {k: [0, 0.0] for k in kinds}
    thr_pairs: list[float] = []
    for i in range(args.key_segments):
        per = {}
        for k in (("plain", "limited") if i % 2 == 0 else ("limited", "plain")):
            done, cpu = asyncio.run(keyed_throughput(st.gateway, kinds[k], gw, args.concurrency, args.key_seconds))
            thr[k][0] += done
            thr[k][1] += cpu
            per[k] = cpu / done
        thr_pairs.append(per["limited"] / per["plain"])
    paced = {k: [0, 0.0] for k in kinds}
    paced_pairs: list[float] = []
    for i in range(args.paced_segments):
        per = {}
        for k in (("plain", "limited") if i % 2 == 0 else ("limited", "plain")):
            ev, cpu = asyncio.run(keyed_paced(st.gateway, kinds[k], gw, args.paced_streams, args.paced_tokens))
            paced[k][0] += ev
            paced[k][1] += cpu
            per[k] = cpu / ev
        paced_pairs.append(per["limited"] / per["plain"])
    used = httpx.get(st.admin + "/admin/v1/usage", params={"tenant": "bench", "since": "1h"}, timeout=30,
                     headers=st.admin_headers).json()
    return {"idle_before": idle_before, "idle_after": idle_after, "lat": lat, "thr": thr, "paced": paced,
            "lat_pairs": lat.pop("pairs"), "thr_pairs": thr_pairs, "paced_pairs": paced_pairs,
            "counted": used["rows"][0] if used["rows"] else None}


def print_keys(k: dict, args) -> None:
    lat, thr, paced = k["lat"], k["thr"], k["paced"]
    print(f"keys and limits, one gateway: `plain` a key of no tenant, `limited` a key of a tenant with "
          f"{args.limits or json.dumps(LIMITS)}:")
    print(f"  latency, one request at a time, {args.key_blocks} alternating blocks of {args.key_block} per kind:")
    for name, v in lat.items():
        print(f"    {name:8} p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms  CPU {v['cpu_us']:.0f} us/request")
    print(f"  throughput, {args.concurrency} concurrent, {args.key_segments} alternating segments of "
          f"{args.key_seconds:g}s per kind:")
    for name, (done, cpu) in thr.items():
        print(f"    {name:8} {done / (args.key_segments * args.key_seconds):.0f} req/s  CPU {cpu / done * 1e6:.0f} us/request")
    print(f"  paced streams, {args.paced_segments} alternating segments per kind of {args.paced_streams} streams of "
          f"{args.paced_tokens} tokens at {args.paced_rate:g} tokens/s:")
    for name, (ev, cpu) in paced.items():
        print(f"    {name:8} {ev} events  CPU {cpu / ev * 1e6:.1f} us/event")
    print(f"  idle gateway CPU: {k['idle_before']:.1f} ms/s with no accounted key, {k['idle_after']:.1f} ms/s with one "
          "(the usage sync each second)")
    c = k["counted"]
    if c:
        print(f"  counted for tenant bench: {c['requests']} requests, {c['prompt_tokens']} prompt and "
              f"{c['completion_tokens']} completion tokens")
    r1 = lat["limited"]["cpu_us"] / lat["plain"]["cpu_us"]
    r16 = (thr["limited"][1] / thr["limited"][0]) / (thr["plain"][1] / thr["plain"][0])
    rev = (paced["limited"][1] / paced["limited"][0]) / (paced["plain"][1] / paced["plain"][0])
    print(f"limited/plain: CPU per request at c=1 {r1:.3f} (median of pairs {median(k['lat_pairs']):.3f}), at "
          f"c={args.concurrency} {r16:.3f} (median of pairs {median(k['thr_pairs']):.3f}); CPU per streamed event "
          f"{rev:.3f} (median of pairs {median(k['paced_pairs']):.3f}); latency p50 "
          f"{lat['limited']['p50'] / lat['plain']['p50']:.3f} (target: each within 1.10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per path in the latency phase")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0, help="per throughput run")
    ap.add_argument("--stream-tokens", type=int, default=20000)
    ap.add_argument("--gateway-cpu", type=int, default=0, help="the one core the gateway may use")
    ap.add_argument("--key-blocks", type=int, default=20, help="alternating blocks per kind (keys and limits)")
    ap.add_argument("--key-block", type=int, default=200, help="requests per block, one at a time")
    ap.add_argument("--key-segments", type=int, default=6, help="alternating throughput segments per kind")
    ap.add_argument("--key-seconds", type=float, default=2.0, help="per throughput segment (keys and limits)")
    ap.add_argument("--paced-streams", type=int, default=50)
    ap.add_argument("--paced-tokens", type=int, default=300)
    ap.add_argument("--paced-rate", type=float, default=100.0, help="tokens per second of each paced stream")
    ap.add_argument("--paced-segments", type=int, default=4)
    ap.add_argument("--no-keys", action="store_true", help="skip the keys-and-limits phase")
    ap.add_argument("--same", action="store_true", help="both kinds keys of no tenant: the method's own bias")
    ap.add_argument("--limits", help="the tenant's limits as JSON (default: every kind, none reached)")
    args = ap.parse_args()

    with Stack(args.gateway_cpu, slow_tokens_per_second=args.paced_rate) as st:
        gw, eng = st.gateway_proc, st.engine_proc
        lat = asyncio.run(latency(st.direct, st.gateway, args.requests, gw))
        thr_d = asyncio.run(throughput(st.direct, args.concurrency, args.seconds, {"engine": eng}))
        thr_g = asyncio.run(throughput(st.gateway, args.concurrency, args.seconds, {"gateway": gw, "engine": eng}))
        st_d = asyncio.run(stream(st.direct, args.stream_tokens))
        st_g = asyncio.run(stream(st.gateway, args.stream_tokens, gw))
        keyed = None if args.no_keys else keys_and_limits(st, args)

    print(f"llmgw gateway overhead (sim engine, zero delay; gateway on cpu {args.gateway_cpu}, "
          f"engine + client on cpus {sorted(st.others)}; {os.cpu_count()} cpus)")
    print(f"latency, one request at a time ({args.requests} each, interleaved):")
    print(f"  direct   p50 {lat['direct_p50_ms']:.3f} ms  p99 {lat['direct_p99_ms']:.3f} ms")
    print(f"  gateway  p50 {lat['gateway_p50_ms']:.3f} ms  p99 {lat['gateway_p99_ms']:.3f} ms")
    print(f"  added    p50 {lat['added_p50_ms']:.3f} ms  p99 {lat['added_p99_ms']:.3f} ms  "
          f"mean {lat['added_mean_ms']:.3f} ms  "
          f"(gateway/direct p50 {lat['gateway_p50_ms'] / lat['direct_p50_ms']:.2f}x)")
    print(f"  gateway CPU per request: {lat['gateway_cpu_us_per_request']:.0f} us "
          f"(= {1e6 / lat['gateway_cpu_us_per_request']:.0f} req/s per gateway core)")
    print(f"throughput, {args.concurrency} concurrent, {args.seconds:g}s each:")
    print(f"  direct   {thr_d['req_s']:.0f} req/s  (engine core {thr_d['engine_core_util']:.2f}, "
          f"engine CPU {thr_d['engine_cpu_us_per_request']:.0f} us/request)")
    print(f"  gateway  {thr_g['req_s']:.0f} req/s  (gateway/direct {thr_g['req_s'] / thr_d['req_s']:.2f}x; "
          f"gateway core {thr_g['gateway_core_util']:.2f}, engine core {thr_g['engine_core_util']:.2f})")
    print(f"  gateway CPU {thr_g['gateway_cpu_us_per_request']:.0f} us/request "
          f"= {1e6 / thr_g['gateway_cpu_us_per_request']:.0f} req/s per gateway core "
          f"(engine alone: {thr_d['engine_cpu_us_per_request']:.0f} us/request)")
    print(f"streaming relay, one stream of {args.stream_tokens} tokens:")
    print(f"  direct   {st_d['events_s']:.0f} events/s  {st_d['mb_s']:.1f} MB/s")
    print(f"  gateway  {st_g['events_s']:.0f} events/s  {st_g['mb_s']:.1f} MB/s  "
          f"(gateway/direct {st_g['events_s'] / st_d['events_s']:.2f}x; "
          f"gateway CPU {st_g['relay_cpu_us_per_event']:.0f} us/event)")
    if keyed is not None:
        print_keys(keyed, args)


if __name__ == "__main__":
    main()
