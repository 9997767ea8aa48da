"""Cold start: request -> first token for an on-demand sim model, against the sim engine's own
start-to-healthy time measured in the same run, with the time broken down by phase (issue 13).

Starts an embedded PostgreSQL, a Temporal dev server, `llmgw server`, `llmgw worker` and one simulated
`llmgw agent` on free ports; applies N on-demand sim models (`--tokens-per-second 0`, nothing to fetch),
then asks each one once with a streaming request and times the first token. The phases come from the
database (demand, placement and ready times), the replica's start workflow history (fetch, launch,
readiness) and the client (first token). Interleaved with the requests, the sim engine is started on its
own N times (spawn -> /health 200), which is what no orchestration can remove.

    .venv/bin/python bench/coldstart.py [--runs 15] [--dynamic-config KEY=VALUE ...]

`--dynamic-config` passes a Temporal server setting to this run's dev server (for example
`system.enableActivityEagerExecution=true`), to compare it against a run with the defaults.

Orchestration overhead = total - the engine's own start. Prints a table of p50/p90 per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import psycopg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import Client  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402

from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from tests.fleet import sim_spec  # noqa: E402
from tests.helpers import ControlPlane  # noqa: E402

PHASES = ["demand recorded, woken", "reconcile pass placed it", "start workflow began", "launch",
          "readiness detected, marked ready", "route updated, first token"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def engine_start_s() -> float:
    """Spawn the sim engine and poll /health every 2 ms until it answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--model", "x", "--port", str(port),
                          "--tokens-per-second", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client() as c:
            while True:
                try:
                    if c.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.002)
    finally:
        p.terminate()
        p.wait()


async def first_token(gateway: str, model: str) -> tuple[float, float]:
    """(wall time sent, seconds to the first `data:` line) for one streaming request."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(timeout=120) as c:
        sent = time.time()
        t0 = time.perf_counter()
        async with c.stream("POST", gateway + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return sent, time.perf_counter() - t0
    raise RuntimeError(f"{model}: no data line")


async def demand_signal_time(temporal: str, namespace: str, model: str) -> float:
    """Epoch seconds when the reconciler received the gateway's first wake-up for `model` (demand recorded,
    reconciler signalled), from the reconciler's history (current run and those before it)."""
    client = await Client.connect(temporal, namespace=namespace, data_converter=pydantic_data_converter)
    async for wf in client.list_workflows("WorkflowId = 'reconciler'"):
        h = await client.get_workflow_handle("reconciler", run_id=wf.run_id).fetch_history()
        for e in h.events:
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                payloads = e.workflow_execution_signaled_event_attributes.input.payloads
                if payloads and payloads[0].data.decode().strip('"') == f"demand for {model}":
                    return e.event_time.ToDatetime().timestamp()
    raise RuntimeError(f"no demand signal for {model}")


async def reconciler_steps(temporal: str, namespace: str, model: str, replica_id: str) -> dict[str, float]:
    """Seconds per step of the reconciler's pass that placed `replica_id`: from the demand signal to the
    `decide` activity (queued, ran; it starts the start workflow itself), and, for a pass from before
    that, `record_placements` and the child start, from its history."""
    client = await Client.connect(temporal, namespace=namespace, data_converter=pydantic_data_converter)
    async for wf in client.list_workflows("WorkflowId = 'reconciler'"):
        h = await client.get_workflow_handle("reconciler", run_id=wf.run_id).fetch_history()
        signal = None
        names: dict[int, str] = {}
        after: set[int] = set()  # activities scheduled after the signal
        t: dict[str, float] = {}
        for e in h.events:
            at = e.event_time.ToDatetime().timestamp()
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:  # named even before the signal:
                names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name  # (a pass under way)
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                payloads = e.workflow_execution_signaled_event_attributes.input.payloads
                if payloads and payloads[0].data.decode().strip('"') == f"demand for {model}":
                    signal, t, after = at, {}, set()
            elif signal is None:
                continue
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                t.setdefault(names[e.event_id] + " scheduled", at)
                after.add(e.event_id)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                sid = e.activity_task_started_event_attributes.scheduled_event_id
                if sid in after:  # not the end of a pass that was under way when the signal came
                    t.setdefault(names[sid] + " started", at)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                sid = e.activity_task_completed_event_attributes.scheduled_event_id
                if sid in after:
                    t.setdefault(names[sid] + " completed", at)
            elif e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
                if e.start_child_workflow_execution_initiated_event_attributes.workflow_id == f"replica/{replica_id}/start":
                    t["child initiated"] = at
                    break
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and "decide completed" in t:
                break  # the pass's task after `decide`: a start `decide` made itself has no child to initiate
        if signal is not None and "decide completed" in t:
            out = {"  signal -> decide scheduled": t["decide scheduled"] - signal,
                   "  decide queued": t["decide started"] - t["decide scheduled"],
                   "  decide ran": t["decide completed"] - t["decide started"]}
            last = t["decide completed"]
            if "record_placements completed" in t:
                out["  -> record_placements done"] = t["record_placements completed"] - last
                last = t["record_placements completed"]
            if "child initiated" in t:  # a pass from before `decide` started what it placed
                out["  -> child initiated"] = t["child initiated"] - last
            return out
    return {}


async def workflow_times(temporal: str, namespace: str, replica_id: str) -> tuple[dict[str, float], dict[str, float]]:
    """Epoch seconds of the start workflow's milestones, and seconds spent per step (each activity's time
    queued and running, and the workflow's own time between them), from its history."""
    client = await Client.connect(temporal, namespace=namespace, data_converter=pydantic_data_converter)
    h = await client.get_workflow_handle(f"replica/{replica_id}/start").fetch_history()
    out: dict[str, float] = {"started": h.events[0].event_time.ToDatetime().timestamp()}
    steps: dict[str, float] = {}
    scheduled: dict[int, tuple[str, float]] = {}
    started: dict[int, float] = {}
    last = out["started"]
    wft = wft_started = last
    n_wft = 0
    seen: dict[str, int] = {}
    for e in h.events:
        t = e.event_time.ToDatetime().timestamp()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            seen[name] = seen.get(name, 0) + 1
            name = f"{name}#{seen[name]}" if seen[name] > 1 else name
            scheduled[e.event_id] = (name, t)
            steps["workflow tasks"] = steps.get("workflow tasks", 0.0) + (t - last)
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            wft = t
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            wft_started = t
            n_wft += 1
            steps[f"  workflow task {n_wft} queued"] = t - wft
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            steps[f"  workflow task {n_wft} in the worker"] = t - wft_started
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            sid = e.activity_task_started_event_attributes.scheduled_event_id
            started[sid] = t
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            name, st = scheduled[sid]
            out.setdefault(name.split("#")[0], t)
            steps[f"  {name} queued"] = started.get(sid, st) - st
            steps[f"  {name} ran"] = t - started.get(sid, st)
            last = t
    return out, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--dynamic-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a Temporal server setting for this run (repeatable), to compare one against the default")
    args = ap.parse_args()
    if any("=" not in kv for kv in args.dynamic_config):
        ap.error("--dynamic-config takes KEY=VALUE, e.g. system.enableActivityEagerExecution=true")
    dyn = dict(kv.split("=", 1) for kv in args.dynamic_config)
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-cold-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "pg.log", database="bench", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log", namespaces=["bench"],
                                  dynamic_config=dyn)
    cp = None
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_TEMPORAL_NAMESPACE="bench",
                          LLMGW_RECONCILE_INTERVAL_S="30")
        cp.start()
        cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=256))
        cp.wait_nodes("n1")
        names = [f"cold-{i}" for i in range(args.runs)]
        cp.apply({"models": [{"name": n, "scaling": {"min": 0, "max": 1, "idle_timeout": "1h"},
                              "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]} for n in names]})
        time.sleep(3)  # the route table has the models; the reconciler's passes are quiet
        engine, rows, details, in_run = [], [], [], []
        for n in names:
            engine.append(engine_start_s())
            sent, ttft = asyncio.run(first_token(cp.gateway, n))
            time.sleep(0.5)  # let the rows settle before reading them
            demand = asyncio.run(demand_signal_time(temporal.address, "bench", n))
            with psycopg.connect(pg.url.replace("+psycopg", "")) as conn:
                rid, created, ready = conn.execute(
                    "select id, extract(epoch from created_at), extract(epoch from ready_at) from replicas "
                    "where model=%s", (n,)).fetchone()
            wf, steps = asyncio.run(workflow_times(temporal.address, "bench", rid))
            details.append({**asyncio.run(reconciler_steps(temporal.address, "bench", n, rid)), **steps})
            # Readiness is pushed by the node (ready_at is set before the start's wait_shard_ready completes).
            # The node step that launches: `start_shard` (fetch and launch in one activity), or `launch_shard`
            # after `fetch_weights` (a start recorded before `issue13-one-node-step`).
            launch = "start_shard" if "start_shard" in wf else "launch_shard"
            marks = [sent, float(demand), float(created), wf["started"], wf[launch], float(ready), sent + ttft]
            rows.append({"total": ttft, **{p: b - a for p, a, b in zip(PHASES, marks, marks[1:])}})
            # The engine's own start in this run: from the launch activity starting (the spawn follows at once)
            # to the node's pushed "ready". Total minus that is what orchestration cost this request, free of
            # the engine's start-time variance between runs (100-270 ms on this machine within minutes).
            launched = wf[launch] - steps[f"  {launch} ran"]
            in_run.append(ttft - (float(ready) - launched))
            print(f"{n}: first token after {ttft * 1000:.0f} ms (engine alone {engine[-1] * 1000:.0f} ms)", flush=True)
        print()
        print(f"{'phase':<32}{'p50 ms':>10}{'p90 ms':>10}")
        for p in [*PHASES, "total"]:
            xs = [r[p] for r in rows]
            print(f"{p:<32}{pct(xs, 0.5) * 1000:>10.1f}{pct(xs, 0.9) * 1000:>10.1f}")
        print(f"{'engine start-to-healthy alone':<32}{pct(engine, 0.5) * 1000:>10.1f}{pct(engine, 0.9) * 1000:>10.1f}")
        over = [r["total"] - e for r, e in zip(rows, engine)]
        print(f"{'orchestration overhead':<32}{pct(over, 0.5) * 1000:>10.1f}{pct(over, 0.9) * 1000:>10.1f}"
              f"   (total - engine alone, paired by run; target p50 <= 50 ms)")
        print(f"{'  the same, engine timed in-run':<32}{pct(in_run, 0.5) * 1000:>10.1f}{pct(in_run, 0.9) * 1000:>10.1f}"
              f"   (total - (launch activity started -> ready pushed) of the same run)")
        print("\nstep by step: the reconciler's pass, then the start workflow (activities queued and running, "
              "workflow tasks between them)")
        for k in max(details, key=len):
            xs = [d[k] for d in details if k in d]
            print(f"{k:<32}{pct(xs, 0.5) * 1000:>10.1f}{pct(xs, 0.9) * 1000:>10.1f}")
        print(f"\n{datetime.now():%Y-%m-%d %H:%M}, {args.runs} runs, server settings {dyn or 'default'}, load average "
              f"{open('/proc/loadavg').read().split()[0]}")
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
