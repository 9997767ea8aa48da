"""How many nodes one fleet simulator and the Temporal dev server take on this machine (issue 42).

    .venv/bin/python bench/fleet_scale.py                          # 100, 300, 1000 nodes
    .venv/bin/python bench/fleet_scale.py --nodes 2000 --heartbeat 10

The control plane is real (embedded PostgreSQL, the Temporal dev server with its default 60 s long polls,
`llmgw server`, `llmgw worker`). Per size, one `llmgw sim-fleet` process with N nodes (each its own
certificate, registration, heartbeats and Temporal worker on `node/<id>` with one activity poll): timed until
the admin API lists all N Ready, and until Temporal's task-queue description (`DescribeTaskQueue`, read by
the same code the liveness witness uses: control/liveness.py) shows a poller on every one of the N queues.
Then everything stands idle for `--idle` seconds: the CPU each process uses per second (cores), and the
simulator's resident memory, are printed per node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.control.liveness import poll_ages  # noqa: E402
from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from bench.bringup import KINDS  # noqa: E402
from tests.fleet import sim_spec  # noqa: E402
from tests.helpers import ControlPlane  # noqa: E402


def by_kind() -> dict[str, list[psutil.Process]]:
    out: dict[str, list[psutil.Process]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        out.setdefault(next((k for pat, k in KINDS if pat in cmd), "other"), []).append(p)
    return out


def cpu(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    out = {}
    for kind, ps in procs.items():
        total = 0.0
        for p in ps:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[kind] = total
    return out


async def polling(address: str, ids: list[str], timeout_s: float) -> tuple[float | None, int]:
    """(seconds until every queue in `ids` shows a poller or None, how many did at the end)."""
    from llmgw.temporal import connect
    from llmgw.config import Settings

    client = await connect(Settings(temporal_address=address))
    t0 = time.monotonic()
    seen: set[str] = set()
    while time.monotonic() - t0 < timeout_s:
        ages, _, err = await poll_ages(client, [n for n in ids if n not in seen], budget_s=30, limit_s=60)
        if err:
            print(f"pollers unreadable: {err}", file=sys.stderr)
        seen |= set(ages)
        if len(seen) == len(ids):
            return time.monotonic() - t0, len(seen)
        await asyncio.sleep(0.5)
    return None, len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="100,300,1000", help="sizes, comma-separated (each 1 to 5000)")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="the nodes' heartbeat interval, seconds")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds measured at rest per size")
    ap.add_argument("--temporal-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a dynamic config value of the Temporal dev server, e.g. frontend.namespaceCount=5000 "
                         "(its limit of concurrent polls per namespace, 1,200 by default); repeatable")
    ap.add_argument("--poll-timeout", type=float, default=120, help="seconds to wait for every queue's poller")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped (`timeout`): everything started is stopped
    sizes = [int(x) for x in args.nodes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="llmgw-fleetscale-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log",
                                 dynamic_config=dict(kv.split("=", 1) for kv in args.temporal_config))
    cp = None
    rows = []
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_RECONCILE_INTERVAL_S="10",
                          LLMGW_HEARTBEAT_INTERVAL_S=str(args.heartbeat), LLMGW_POLLER_GRACE_S="60",
                          LLMGW_NODE_UNREACHABLE_AFTER_S=str(max(15.0, args.heartbeat * 4)))
        cp.start()
        for n in sizes:
            prefix = f"s{n}-"
            ids = [f"{prefix}{i:0{max(2, len(str(n - 1)))}d}" for i in range(n)]
            t0 = time.monotonic()
            sim = cp.spawn(f"sim-fleet-{n}", "sim-fleet", "--nodes", str(n), "--node-prefix", prefix, "--issue-certs",
                           "--simulate", sim_spec(gpus=1), env={"LLMGW_PEER_PORT": "-1"})
            cp.wait_nodes(*ids, timeout_s=600)
            registered = time.monotonic() - t0
            polled, seen = asyncio.run(polling(temporal.address, ids, args.poll_timeout))
            procs = by_kind()
            c0, w0 = cpu(procs), time.monotonic()
            time.sleep(args.idle)
            c1, wall = cpu(procs), time.monotonic() - w0
            rss = psutil.Process(sim.proc.pid).memory_info().rss
            rows.append((n, registered, polled, seen, {k: (c1[k] - c0.get(k, 0)) / wall for k in c1}, rss))
            refused = sum(1 for line in open(sim.log_path, errors="replace") if "concurrent poller limit" in line)
            print(f"{n} nodes: registered in {registered:.1f} s, {seen} queues polled "
                  f"({f'all in {polled:.1f} s' if polled is not None else 'NOT all'}), polls refused by Temporal "
                  f"{refused} times; at rest: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1][4].items()),
                  file=sys.stderr)
            sim.stop(grace_s=60)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n{len(os.sched_getaffinity(0))} cores, load average {load} at the end; heartbeats every "
              f"{args.heartbeat:g} s, Temporal's default long poll (60 s)\n")
        print(f"{'nodes':>6s} {'all Ready':>9s} {'all polling':>11s} {'simulator':>10s} {'per node':>9s} {'RSS/node':>9s} "
              f"{'temporal':>9s} {'node API':>9s} {'worker':>7s} {'server':>7s} {'postgres':>8s}   (cores at rest)")
        for n, reg, polled, seen, c, rss in rows:
            pol = f"{polled:.1f} s" if polled is not None else f"{seen}/{n}"
            print(f"{n:>6d} {reg:>7.1f} s {pol:>11s} {c.get('simulator', 0):>10.3f} {c.get('simulator', 0) / n * 1e3:>6.2f} m "
                  f"{rss / n / 1024:>6.0f} KiB {c.get('temporal', 0):>9.3f} {c.get('node API', 0):>9.3f} "
                  f"{c.get('worker', 0):>7.3f} {c.get('server', 0):>7.3f} {c.get('postgres', 0):>8.3f}")
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
