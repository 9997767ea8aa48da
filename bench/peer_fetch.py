"""A fetch from a peer node against the same fetch from the mirror, measured in one run (issue 39, target:
the peer at >= 0.8x the mirror's throughput).

What it starts, in a process of its own: the mirror's byte listener (plain HTTP, as `llmgw mirror serve`
runs it) and a node's peer listener (`node/peer_server.py`: the same app over mutual TLS with node
certificates from a CA made for the run), over one file of `--size` bytes (hard-linked under both names,
page cache warm). Then, alternating, `--rounds` times each, the node's fetcher (`Fetcher.fetch` of a
`mirror:` source) into an empty cache:
- from the mirror alone (no peers);
- from the peer (`peers=[node-a]`): the bytes over TLS, the digest from the mirror (one `HEAD`).
Both verify the sha256, fsync and rename. Prints each one's median MB/s and the ratio peer/mirror.

Run: `.venv/bin/python bench/peer_fetch.py` (about a minute for 1 GiB; `--size 256M` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.config import Settings  # noqa: E402
from llmgw.dev.procs import free_port, wait_port  # noqa: E402
from llmgw.node.peer_server import client_context  # noqa: E402
from llmgw.security.pki import create_ca, issue_node  # noqa: E402
from llmgw.weights.fetcher import Fetcher, Peer  # noqa: E402
from llmgw.weights.naming import cache_name_for  # noqa: E402

SERVE = """
import asyncio, sys, threading, uvicorn
from pathlib import Path
from llmgw.config import Settings
from llmgw.node.peer_server import PeerListener
from llmgw.weights.files_app import create_files_app
root, cache, pki, mport, pport = sys.argv[1:6]
pki = Path(pki)
s = Settings(state_dir=Path(cache).parent / "state", node_id="node-a", ca_cert=pki / "ca.crt",
             node_cert=pki / "node-node-a.crt", node_key=pki / "node-node-a.key", peer_port=int(pport))
peer = PeerListener(s, Path(cache))
assert peer.bind()
mirror = uvicorn.Server(uvicorn.Config(create_files_app(Path(root)), host="127.0.0.1", port=int(mport),
                                       log_level="warning"))
threading.Thread(target=mirror.run, daemon=True).start()
asyncio.run(peer.run())
"""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


async def fetch_once(fetcher_of, peers) -> float:
    f: Fetcher = fetcher_of()
    t0 = time.perf_counter()
    got = await f.fetch("mirror:w.bin", peers=peers)
    took = time.perf_counter() - t0
    assert got.fetched and (got.peers == ("node-a",)) == bool(peers), got
    shutil.rmtree(f.cache_dir)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    size = parse_size(args.size)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-peer-bench-"))
    server = None
    try:
        pki = tmp / "pki"
        create_ca(pki)
        for n in ("node-a", "node-b"):
            issue_node(pki, n)
        root, cache = tmp / "mirror", tmp / "cache-a"
        root.mkdir()
        cache.mkdir()
        with open(root / "w.bin", "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(size // len(block)):
                f.write(block)
        os.link(root / "w.bin", cache / cache_name_for("mirror:w.bin"))
        (root / "w.bin").read_bytes()  # the page cache warm for both
        mport, pport = free_port(), free_port()
        server = subprocess.Popen([sys.executable, "-c", SERVE, str(root), str(cache), str(pki), str(mport), str(pport)],
                                  env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        wait_port(mport, 30, server, "mirror")
        wait_port(pport, 30, server, "peer listener")
        b = Settings(state_dir=tmp / "state-b", node_id="node-b", ca_cert=pki / "ca.crt",
                     node_cert=pki / "node-node-b.crt", node_key=pki / "node-node-b.key")
        ctx = client_context(b)
        n = [0]

        def fetcher_of() -> Fetcher:
            n[0] += 1
            return Fetcher(tmp / f"cache-b-{n[0]}", f"http://127.0.0.1:{mport}", peer_tls=lambda: ctx)

        peer = [Peer("node-a", f"https://127.0.0.1:{pport}")]
        times: dict[str, list[float]] = {"mirror": [], "peer": []}
        for _ in range(args.rounds):
            times["mirror"].append(asyncio.run(fetch_once(fetcher_of, None)))
            times["peer"].append(asyncio.run(fetch_once(fetcher_of, peer)))
        mb = {k: size / statistics.median(v) / 1e6 for k, v in times.items()}
        print(f"file {size / (1 << 20):.0f} MiB, {args.rounds} rounds each, alternating; median MB/s:")
        print(f"  mirror (plain HTTP)      {mb['mirror']:8.1f}")
        print(f"  peer (mutual TLS)        {mb['peer']:8.1f}")
        print(f"peer / mirror: {mb['peer'] / mb['mirror']:.2f}x (target >= 0.8x)")
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
