"""Weight fetch throughput against curl, and what a resume fetches twice, measured in one run.

What it starts: the test suite's origin server (`tests/origin_server.py`, a plain HTTP file server that
sends with sendfile) as its own process, serving one file of `--size` bytes (1 GiB by default) from a
temporary directory. Then, alternating, `--rounds` times each:
- `curl` writing the file to disk (the baseline: no hashing, no checks);
- the mirror's fetch (`download()` with the address policy, as the `fetch_mirror_file` activity runs it:
  sha256 while downloading, fsync, rename);
- the node's fetcher (`Fetcher.fetch` of an http source: the same, plus the lock and single flight).
Every copy is removed before the next, and the page cache is warm for all (the origin's file is read once
before timing). It prints each one's median MB/s and its ratio to curl's median (target >= 0.8x).

Resume: what a resume fetches again, measured at the origin (bytes it sent, per response, and where the
resumed request asked to start):
- a connection dropped at a random offset: bytes sent before the drop minus the resume offset;
- the fetching process SIGKILLed at a random moment: the same difference. Here it also counts what was in
  flight in the kernel's socket buffers (sent by the origin, never read by the killed process), which no
  client can keep; the client's own loss is at most one chunk (1 MiB), what it had read and not written.
The target is at most one chunk.

Run: `.venv/bin/python bench/fetch.py` (about a minute for 1 GiB; `--size 256M` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.weights.download import CHUNK, download, target_lock  # noqa: E402
from llmgw.weights.fetcher import Fetcher  # noqa: E402
from llmgw.weights.urls import AddressPolicy  # noqa: E402


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


class Origin:
    def __init__(self, root: Path, config: dict | None = None):
        self.port = free_port()
        self.log = root.parent / f"origin-{self.port}.jsonl"
        cfg = {"log_file": str(self.log), **(config or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.origin_server", str(root), str(self.port),
                                      json.dumps(cfg)], cwd=REPO, stdout=subprocess.DEVNULL, start_new_session=True)
        from llmgw.dev.procs import wait_port

        wait_port(self.port, 20, self.proc, "origin")
        self.url = f"http://127.0.0.1:{self.port}"

    def entries(self) -> list[dict]:
        return [json.loads(x) for x in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)


def curl(url: str, dest: Path) -> tuple[float, float, float]:
    """(wall seconds, user and system CPU seconds of curl)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sS", "--fail", "-o", str(dest), url], check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def timed(coro_fn) -> tuple[float, float, float]:
    """(wall seconds, user and system CPU seconds of this process, all threads) of running `coro_fn()`."""
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    asyncio.run(coro_fn())
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


async def mirror_fetch(url: str, work: Path) -> None:
    policy = AddressPolicy.parse("127.0.0.1/32")
    async with target_lock(work, work / "f.bin"):
        await download(url, work / "f.bin", work, policy=policy)


async def node_fetch(url: str, cache: Path) -> None:
    await Fetcher(cache, None).fetch(url)


def clean(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)


def throughput(root: Path, size: int, rounds: int) -> None:
    """Each round runs the three in another order (curl, node, mirror; then node, mirror, curl; ...): on a
    virtual machine the kernel's cost of writing a file into the page cache varies by 3x from one run to the
    next (bench/README.md), and which writer comes first after another's file was deleted mattered more
    than what it was."""
    origin = Origin(root)
    url = origin.url + "/f.bin"
    tmp = root.parent
    out, work, cache = tmp / "curl", tmp / "mirror", tmp / "cache"
    times: dict[str, list[tuple[float, float, float]]] = {"curl": [], "node fetcher": [], "mirror fetch": []}
    order = list(times)
    try:
        subprocess.run(["cat", str(root / "f.bin")], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        for i in range(rounds):
            for name in order[i % 3:] + order[:i % 3]:
                clean(out, work, cache)
                os.sync()  # no dirty pages left from the previous copy (curl's is never fsynced)
                if name == "curl":
                    times[name].append(curl(url, out / "f.bin"))
                elif name == "mirror fetch":
                    times[name].append(timed(lambda: mirror_fetch(url, work)))
                else:
                    times[name].append(timed(lambda: node_fetch(url, cache)))
    finally:
        origin.stop()
        clean(out, work, cache)
    base = statistics.median(t for t, _, _ in times["curl"])
    print(f"\nthroughput, {size / 2**30:.2f} GiB file, median of {rounds} (order rotated per round), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (MB/s = 10^6 bytes/s; CPU s/GB of the fetching process: "
          "user = its own work, sys = the kernel's, mostly receiving and writing)")
    print(f"{'':16s} {'MB/s':>8s} {'ratio to curl':>14s} {'user s/GB':>10s} {'sys s/GB':>9s}   wall per run (s)")
    for name, runs in times.items():
        med = statistics.median(t for t, _, _ in runs)
        user = statistics.median(u for _, u, _ in runs)
        sys_ = statistics.median(k for _, _, k in runs)
        print(f"{name:16s} {size / med / 1e6:8.0f} {base / med:13.2f}x {user / size * 1e9:10.2f} {sys_ / size * 1e9:9.2f}"
              f"   {' '.join(f'{t:.2f}' for t, _, _ in runs)}")


def resume_after_drop(root: Path, size: int) -> tuple[int, int, int]:
    """(drop offset, bytes sent before the drop, resume offset)."""
    at = random.randrange(size // 4, 3 * size // 4)
    origin = Origin(root, {"drop": {"/f.bin": at}})
    work = root.parent / "drop"
    clean(work)
    try:
        async def go() -> None:
            policy = AddressPolicy.parse("127.0.0.1/32")
            for _ in range(3):
                try:
                    async with target_lock(work, work / "f.bin"):
                        await download(origin.url + "/f.bin", work / "f.bin", work, policy=policy)
                    return
                except Exception:  # noqa: BLE001 - the drop: try again, as the activity's retry does
                    continue
        asyncio.run(go())
        e = [x for x in origin.entries() if x["path"] == "/f.bin"]
        return at, e[0]["sent"], e[1]["start"]
    finally:
        origin.stop()
        shutil.rmtree(work, ignore_errors=True)


_CHILD = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from llmgw.weights.download import download, target_lock
async def go():
    work = Path(sys.argv[2])
    async with target_lock(work, work / "f.bin"):
        await download(sys.argv[1], work / "f.bin", work)
asyncio.run(go())
"""


def resume_after_kill(root: Path, size: int, rate: int) -> tuple[int, int, int]:
    """(bytes on disk at the kill, bytes the origin sent before it, resume offset)."""
    origin = Origin(root, {"rate": rate})
    work = root.parent / "kill"
    clean(work)
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, origin.url + "/f.bin", str(work), str(REPO / "src")],
                                 start_new_session=True)
        deadline = time.monotonic() + 60
        while not sum(p.stat().st_size for p in work.glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the download is under way
        time.sleep(random.uniform(0.2, 1.0))
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(5)
        for _ in range(50):  # the origin notices the broken connection and logs what it sent
            if origin.entries():
                break
            time.sleep(0.1)
        sent = origin.entries()[0]["sent"]
        on_disk = sum(p.stat().st_size for p in work.glob("*.part"))
        origin.stop()
        origin = Origin(root)  # unthrottled for the resume

        async def go() -> None:
            async with target_lock(work, work / "f.bin"):
                await download(origin.url + "/f.bin", work / "f.bin", work)
        asyncio.run(go())
        return on_disk, sent, origin.entries()[0]["start"]
    finally:
        origin.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="file size (1G, 256M, ...)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kill-rate", type=int, default=100_000_000, help="origin rate (bytes/s) while the fetcher is killed")
    ap.add_argument("--dir", default=None, help="where to put the file and the copies (default: a temp dir)")
    args = ap.parse_args()
    size = parse_size(args.size)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-fetch-", dir=args.dir))
    root = tmp / "origin"
    root.mkdir()
    try:
        block = os.urandom(1 << 20)
        with open(root / "f.bin", "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
            f.write(block[: size % len(block)])
        throughput(root, size, args.rounds)
        at, sent, start = resume_after_drop(root, size)
        print(f"\nresume after a dropped connection at byte {at}: the origin sent {sent}, the resume asked from "
              f"{start}: re-fetched {sent - start} bytes (target <= {CHUNK})")
        on_disk, sent, start = resume_after_kill(root, size, args.kill_rate)
        print(f"resume after SIGKILL of the fetching process: {on_disk} bytes on disk, the origin had sent {sent}, "
              f"the resume asked from {start}: the origin sent {sent - start} bytes twice, of which at most {CHUNK} "
              f"were read by the client and the rest sat in socket buffers (target <= {CHUNK} read twice)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
