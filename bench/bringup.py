"""Bring-up measured on orchestration (issue 42): M one-GPU sim models applied at once on N simulated nodes
(one 80 GB GPU each); how soon are they all Ready, and what did it cost whom?

    .venv/bin/python bench/bringup.py                        # 30 x 30, then 100 x 100 (about two minutes)
    .venv/bin/python bench/bringup.py --sizes 30x30          # one size
    .venv/bin/python bench/bringup.py --agents process       # one `llmgw agent` + one engine process per
                                                             # node and replica, as before issue 42

The control plane is real: an embedded PostgreSQL, the Temporal dev server, `llmgw server` and `llmgw worker`
(production timings: heartbeats every 2 s, a reconcile timer of 10 s, poller grace 60 s), on free ports,
stopped at the end (Ctrl-C included). The nodes are one `llmgw sim-fleet` process (node/fleet_sim.py): N real
node workers with their own certificates, registrations, heartbeats and task queues, their replicas served
by one shared sim engine, so the CPU that bring-up costs is the orchestration's, not 900 engine processes'
(before issue 42, 30 x 30 took 22.5 s of which the engines alone used 13.7 CPU-seconds on two cores).

Each size runs on a stack of its own (a fresh database and Temporal dev server: the stops of one size's
replicas never overlap the next size's starts), with its own simulator (node ids `n<N>-00` ...): the nodes
register (timed), then stand idle for `--idle` seconds (the simulator's CPU per node at rest: heartbeats,
polls, probes), then the catalog is applied; the clock starts when the admin API has answered and reads the
replicas every 0.1 s until all are Ready. Printed: seconds to all Ready, placements per second (M / that),
the Ready count at marks, the CPU seconds of each process kind over the bring-up, and the target (<= 5 s for
30 x 30) met or NOT met.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from tests.fleet import sim_spec  # noqa: E402
from tests.helpers import ControlPlane, Proc  # noqa: E402

MARKS_S = (1, 2, 3, 5, 8)
TARGET_S = {30: 5.0}  # issue 42: 30 x 30 all Ready within 5 s
SPEC = sim_spec(gpus=1, gpu_memory_gb=80)


def catalog(models: int) -> dict:
    return {"models": [{"name": f"m{i:03d}", "scaling": {"min": 1, "max": 1},
                        "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}
                       for i in range(models)]}


def ready_count(cp: ControlPlane) -> int:
    return sum(1 for r in httpx.get(cp.admin + "/admin/v1/replicas", timeout=10, headers=cp.admin_headers).json()
               if r["status"] == "ready")


KINDS = (("sim_server", "engines"), ("sim-fleet", "simulator"), ("temporal", "temporal"), ("postgres", "postgres"),
         (" agent", "agents"), (" worker", "worker"), ("node-api", "node API"), (" server", "server"))  # first match wins


def cpu_by_pid() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds, user + system) for every process this bench started, and theirs."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except psutil.Error:
            continue
        kind = next((k for pat, k in KINDS if pat in cmd), "other")
        out[p.pid] = (kind, t.user + t.system)
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    used: dict[str, float] = {}
    for pid, (kind, t) in after.items():
        used[kind] = used.get(kind, 0.0) + t - (before[pid][1] if pid in before else 0.0)
    return used


def start_nodes(cp: ControlPlane, nodes: int, mode: str) -> tuple[list[Proc], list[str], float]:
    """The nodes, registered and Ready: (their processes, node ids, seconds until all were Ready)."""
    names = [f"n{nodes}-{i:0{max(2, len(str(nodes - 1)))}d}" for i in range(nodes)]
    t0 = time.monotonic()
    if mode == "fleet":
        procs = [cp.spawn(f"sim-fleet-{nodes}", "sim-fleet", "--nodes", str(nodes), "--node-prefix", f"n{nodes}-",
                          "--simulate", SPEC, "--issue-certs", "--stop-engines-on-exit")]
    else:
        procs = [cp.agent(n, simulate=SPEC) for n in names]
    cp.wait_nodes(*names, timeout_s=300)
    return procs, names, time.monotonic() - t0


def bring_up(cp: ControlPlane, models: int, timeout_s: float) -> tuple[float | None, dict[int, int], dict[str, float]]:
    """(seconds until every replica was Ready or None, Ready count at each mark, CPU seconds used by kind)."""
    before = cpu_by_pid()
    cp.apply(catalog(models)).raise_for_status()
    t0 = time.monotonic()
    print(f"{models} models applied at {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}", file=sys.stderr)
    curve: list[tuple[float, int]] = []
    done = None
    while time.monotonic() - t0 < timeout_s:
        n = ready_count(cp)
        t = time.monotonic() - t0
        curve.append((t, n))
        if n >= models:
            done = t
            break
        time.sleep(0.1)
    at = {m: max([n for t, n in curve if t <= m], default=0) for m in MARKS_S}
    return done, at, cpu_used(before, cpu_by_pid())


def idle_cpu(procs: list[Proc], seconds: float) -> float:
    """CPU seconds per second the node processes used standing idle for `seconds`."""
    ps = [psutil.Process(p.proc.pid) for p in procs]

    def total() -> float:
        return sum(c.user + c.system for c in (q.cpu_times() for q in ps))
    c0, t0 = total(), time.monotonic()
    time.sleep(seconds)
    return (total() - c0) / (time.monotonic() - t0)


def sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        m, _, n = part.partition("x")
        if not (m.isdigit() and n.isdigit() and 1 <= int(m) <= int(n) <= 2000):
            raise argparse.ArgumentTypeError(f"{part!r}: want MODELSxNODES, 1 <= models <= nodes <= 2000 (30x30)")
        out.append((int(m), int(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=sizes, default=sizes("30x30,100x100"), help="MODELSxNODES, comma-separated")
    ap.add_argument("--agents", choices=("fleet", "process"), default="fleet",
                    help="fleet: one sim-fleet process; process: one agent process per node, one engine per replica")
    ap.add_argument("--idle", type=float, default=10, help="seconds the registered nodes stand idle, measured")
    ap.add_argument("--timeout", type=float, default=180, help="seconds to wait for a bring-up")
    ap.add_argument("--keep", action="store_true", help="keep the state and logs (their directory is printed)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped (`timeout`): everything started is stopped
    root = Path(tempfile.mkdtemp(prefix="llmgw-bringup-"))
    results = []
    try:
        for models, nodes in args.sizes:
            results.append(one_size(root / f"{models}x{nodes}", models, nodes, args))
        report(args.agents, results)
    finally:
        if args.keep:
            print(f"state and logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def one_size(root: Path, models: int, nodes: int, args: argparse.Namespace) -> tuple:
    """One bring-up on a stack of its own (a fresh database and Temporal: nothing left from another size)."""
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log")
    cp = None
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_RECONCILE_INTERVAL_S="10",
                          LLMGW_HEARTBEAT_INTERVAL_S="2", LLMGW_POLLER_GRACE_S="60")
        cp.start()
        procs, _, registered_s = start_nodes(cp, nodes, args.agents)
        print(f"{nodes} nodes registered in {registered_s:.1f} s", file=sys.stderr)
        idle = idle_cpu(procs, args.idle)
        done, at, cpu = bring_up(cp, models, args.timeout)
        print(f"{models} x {nodes}: {'all Ready' if done else 'NOT all Ready'}", file=sys.stderr)
        return models, nodes, registered_s, idle, done, at, cpu
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()


def report(mode: str, results: list) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cores = len(os.sched_getaffinity(0))
    nodes_by = "one sim-fleet process" if mode == "fleet" else "one agent process per node, one engine per replica"
    print(f"\nbring-up on {nodes_by}; {cores} cores, load average {load} at the end\n")
    print(f"{'models x nodes':>15s} {'registered':>10s} {'idle CPU/node':>13s} {'all Ready':>9s} {'placements/s':>12s} "
          + " ".join(f"{f'at {m} s':>6s}" for m in MARKS_S) + f" {'CPU used':>9s}")
    for models, nodes, reg, idle, done, at, cpu in results:
        total = f"{done:.2f} s" if done is not None else "never"
        rate = f"{models / done:.1f}" if done else "-"
        print(f"{f'{models} x {nodes}':>15s} {reg:>8.1f} s {idle / nodes * 100:>11.2f} % {total:>9s} {rate:>12s} "
              + " ".join(f"{at[m]:>6d}" for m in MARKS_S) + f" {sum(cpu.values()):>7.1f} s")
    print("\nCPU seconds by process over each bring-up (apply to all Ready):")
    for models, nodes, _, _, _, _, cpu in results:
        print(f"  {f'{models} x {nodes}':>10s}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    for models, nodes, _, _, done, _, _ in results:
        if nodes in TARGET_S and models == nodes:
            ok = done is not None and done <= TARGET_S[nodes]
            print(f"\ntarget: {models} x {nodes} all Ready within {TARGET_S[nodes]:g} s: {'met' if ok else 'NOT met'} "
                  f"({f'{done:.2f} s' if done else 'never'})")


if __name__ == "__main__":
    main()
