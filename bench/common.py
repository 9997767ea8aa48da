"""Shared by the bench scripts: pinning, CPU time, percentiles, and the load generator (aiohttp).

Every figure is measured against the sim engine in the same run as its comparison, interleaved where it
can be, because this kind of machine is shared and its absolute speed drifts from minute to minute.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def pinned(cpus: set[int]):
    def fn() -> None:
        os.sched_setaffinity(0, cpus)
    return fn


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def cpu_exact_s(p: psutil.Process) -> float:
    """CPU seconds of every thread of `p`, from the scheduler's nanosecond counters (`/proc/<pid>/task/*/
    schedstat`), where `cpu_times` counts 10 ms clock ticks: for short segments measured one by one."""
    total = 0
    for task in Path(f"/proc/{p.pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict | None = None) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
    return time.perf_counter() - t0


async def latency(direct: str, gateway: str, n: int, gw: psutil.Process) -> dict:
    """One request at a time, alternating direct and through `gateway`; gateway CPU per request."""
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


async def stream(url: str, tokens: int, relay: psutil.Process | None = None) -> dict:
    """One long SSE stream: events/s and MB/s at the client; with `relay`, its CPU per event."""
    body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
    async with aiohttp.ClientSession() as s:
        cpu0 = cpu_s(relay) if relay else 0.0
        t0 = time.perf_counter()
        n = events = 0
        async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            async for chunk in r.content.iter_any():
                n += len(chunk)
                events += chunk.count(b"\n\n")
        wall = time.perf_counter() - t0
    out = {"events_s": events / wall, "mb_s": n / wall / 1e6}
    if relay:
        out["relay_cpu_us_per_event"] = (cpu_s(relay) - cpu0) / max(1, events) * 1e6
    return out


class Stack:
    """The sim engine (no token delay) and a real `llmgw server` routing model `bench` to it as a static
    endpoint, with the embedded PostgreSQL the gateway reads its routes from. The gateway is pinned to
    `gateway_cpu`; the engine, and whatever else `spawn` starts unpinned, to the other cores.

    Use as a context manager; everything started is stopped on exit, SIGTERM included.
    """

    def __init__(self, gateway_cpu: int = 0, slow_tokens_per_second: float | None = None):
        from llmgw.dev.procs import free_port

        self.gateway_cpu = gateway_cpu
        self.others = (os.sched_getaffinity(0) - {gateway_cpu}) or {gateway_cpu}
        self.tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
        self.procs: list[subprocess.Popen] = []
        self.pg = None
        self.engine_port = free_port()
        # With `slow_tokens_per_second`, a second sim engine, model `bench-slow`, that emits at that rate
        # (bench/streams.py holds many long streams open on it).
        self.slow_tokens_per_second = slow_tokens_per_second
        self.slow_port = free_port()

    @property
    def direct(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}/v1/chat/completions"

    @property
    def direct_slow(self) -> str:
        return f"http://127.0.0.1:{self.slow_port}/v1/chat/completions"

    def spawn(self, argv: list[str], cpus: set[int], env: dict | None = None, log: str = "proc") -> subprocess.Popen:
        with open(self.tmp / f"{log}.log", "ab") as out:
            p = subprocess.Popen(argv, env=env, preexec_fn=pinned(cpus), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def __enter__(self) -> "Stack":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        os.sched_setaffinity(0, self.others)
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        import httpx

        from llmgw.db.migrate import upgrade
        from llmgw.dev.postgres import EmbeddedPostgres
        from llmgw.dev.procs import free_port, wait_port

        self.pg = EmbeddedPostgres(self.tmp / "pg", free_port(), self.tmp / "postgres.log", durable=False)
        self.pg.start()
        upgrade(self.pg.url)
        engine = self.spawn([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(self.engine_port),
                             "--model", "bench", "--tokens-per-second", "0"], self.others, log="engine")
        models = [{"name": "bench", "endpoints": [f"http://127.0.0.1:{self.engine_port}"]}]
        if self.slow_tokens_per_second is not None:
            slow = self.spawn([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(self.slow_port),
                               "--model", "bench-slow", "--tokens-per-second", str(self.slow_tokens_per_second)],
                              self.others, log="engine-slow")
            wait_port(self.slow_port, 30, slow, "slow sim engine")
            models.append({"name": "bench-slow", "endpoints": [f"http://127.0.0.1:{self.slow_port}"]})
            self.slow_engine_proc = psutil.Process(slow.pid)
        gport, aport, nport = free_port(), free_port(), free_port()
        token = "llmgw-admin-" + secrets.token_urlsafe(32)  # the admin API wants it, on loopback too
        self.admin_headers = {"authorization": f"Bearer {token}"}
        env = {**os.environ, "LLMGW_DATABASE_URL": self.pg.url, "LLMGW_STATE_DIR": str(self.tmp / "state"),
               "LLMGW_ADMIN_TOKEN": token,
               "LLMGW_GATEWAY_PORT": str(gport), "LLMGW_ADMIN_PORT": str(aport), "LLMGW_NODE_API_PORT": str(nport),
               "LLMGW_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",  # nothing there: routing needs no Temporal
               # Every bench client is one address (loopback), as every client is behind a proxy: without
               # this, connections past the per-client cap (256) are answered 429 (bench/streams.py's 1,000).
               "LLMGW_MAX_CONNECTIONS_PER_CLIENT": "0"}
        server = self.spawn([sys.executable, "-m", "llmgw", "server", "--no-migrate"], {self.gateway_cpu}, env,
                            "server")
        wait_port(self.engine_port, 30, engine, "sim engine")
        wait_port(aport, 60, server, "admin API")
        httpx.post(f"http://127.0.0.1:{aport}/admin/v1/catalog", timeout=30, headers=self.admin_headers,
                   json={"catalog": {"models": models}}).raise_for_status()
        self.gateway = f"http://127.0.0.1:{gport}/v1/chat/completions"
        self.admin = f"http://127.0.0.1:{aport}"
        deadline = time.monotonic() + 30
        while httpx.post(self.gateway, json=CHAT, timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway never routed `bench`; see {self.tmp / 'server.log'}")
            time.sleep(0.2)
        self.engine_proc = psutil.Process(engine.pid)
        self.gateway_proc = psutil.Process(server.pid)

    def __exit__(self, *exc) -> None:
        from llmgw.dev.procs import stop_process

        for p in reversed(self.procs):
            stop_process(p, grace_s=5)
        if self.pg is not None:
            self.pg.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
