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
- the sim engine alone: its own CPU time per request (it may be the bottleneck, not the gateway).

Run: `.venv/bin/python bench/overhead.py` (about a minute). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from common import Stack, latency, stream, throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per path in the latency phase")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0, help="per throughput run")
    ap.add_argument("--stream-tokens", type=int, default=20000)
    ap.add_argument("--gateway-cpu", type=int, default=0, help="the one core the gateway may use")
    args = ap.parse_args()

    with Stack(args.gateway_cpu) as st:
        gw, eng = st.gateway_proc, st.engine_proc
        lat = asyncio.run(latency(st.direct, st.gateway, args.requests, gw))
        thr_d = asyncio.run(throughput(st.direct, args.concurrency, args.seconds, {"engine": eng}))
        thr_g = asyncio.run(throughput(st.gateway, args.concurrency, args.seconds, {"gateway": gw, "engine": eng}))
        st_d = asyncio.run(stream(st.direct, args.stream_tokens))
        st_g = asyncio.run(stream(st.gateway, args.stream_tokens, gw))

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


if __name__ == "__main__":
    main()
