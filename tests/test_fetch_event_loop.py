"""The node worker's event loop never blocks while weights are verified (issue 9, item 7): resuming a large
partial download hashes what is already on disk, and that runs in a thread, so the loop that also sends the
node's heartbeats keeps turning. A real HTTP server with Range support, the real `Fetcher`."""

from __future__ import annotations

import asyncio
import math
import os
import time

from aiohttp import web

from llmgw.weights.download import sha256_of
from llmgw.weights.fetcher import Fetcher
from llmgw.weights.naming import cache_name_for

PROBE_MB = 256  # sparse partials cost no disk, and still have to be read and hashed
TAIL = b"the rest of the weights\n" * 1000


async def serve_file(size_prefix: int):
    """A file of `size_prefix` zero bytes then TAIL, served with Range support, and the server's URL."""
    total = size_prefix + len(TAIL)

    async def handler(request: web.Request) -> web.StreamResponse:
        start = int(request.headers.get("Range", "bytes=0-")[6:].split("-")[0] or 0)
        assert start >= size_prefix, "the test only serves the tail: the prefix must come from the partial file"
        body = TAIL[start - size_prefix:]
        return web.Response(status=206, body=body, headers={
            "Content-Range": f"bytes {start}-{total - 1}/{total}", "Content-Type": "application/octet-stream"})

    app = web.Application()
    app.router.add_get("/w.bin", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/w.bin"


def hash_seconds(path) -> float:
    """How long verifying `path` takes when nothing else runs (the fastest of two: the second has its cache warm)."""
    times = []
    for _ in range(2):
        started = time.monotonic()
        sha256_of(path)
        times.append(time.monotonic() - started)
    return min(times)


def sparse(path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)  # what an interrupted download left behind


async def test_resuming_a_large_partial_download_does_not_block_the_event_loop(tmp_path):
    # A partial large enough that hashing it takes about a second on this machine, whatever its speed: a
    # fixed 512 MB took only 0.29 s on a machine with SHA extensions, too little to show a stall.
    probe = tmp_path / "probe"
    sparse(probe, PROBE_MB << 20)
    per_probe = hash_seconds(probe)
    probe.unlink()
    prefix = min(32, max(2, math.ceil(1.0 / max(per_probe, 1e-3)))) * (PROBE_MB << 20)
    runner, url = await serve_file(prefix)
    try:
        fetcher = Fetcher(tmp_path / "cache", None)
        partial = fetcher.partial_dir / cache_name_for(url)
        sparse(partial, prefix)
        hash_s = hash_seconds(partial)
        assert hash_s > 0.3, f"hashing {prefix >> 20} MB took only {hash_s:.2f}s: too little to show anything"

        gaps: list[float] = []
        last = [time.monotonic()]

        async def ticker() -> None:  # stands in for the agent's heartbeat loop
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last[0])
                last[0] = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        got = await fetcher.fetch(url)
        gaps.append(time.monotonic() - last[0])
        tick.cancel()
        # The loop turned throughout: no pause near the time the hashing takes.
        assert max(gaps) < hash_s / 2, f"the event loop stalled {max(gaps):.2f}s (hashing takes {hash_s:.2f}s)"
        assert os.path.getsize(got.path) == prefix + len(TAIL) and got.fetched
        with open(got.path, "rb") as f:
            f.seek(prefix)
            assert f.read() == TAIL
    finally:
        await runner.cleanup()
