"""The activation ladder, measured: request -> first token through llmgw for each rung, against the engine
doing the same alone, in one run (issue 39, item 5).

Starts an embedded PostgreSQL, a Temporal dev server, `llmgw server`, `llmgw worker`, the mirror and one
`llmgw agent --simulate` (its engines are real processes) on free ports. Rungs, each timed through the gateway
(a streamed chat request held while the model activates, to its first `data:` line) and alone (the same engine
spawned or called by this script, to its first token):

  sim wake             a sleeping sim replica woken (`scaling.sleep_after`; `--wake-s`); alone: POST /wake_up,
                       then the request
  sim compile cold     a sim engine that "compiles" on a cold compile cache (`--compile-s`) started on demand;
  sim compile warm     the same model started again, its compile cache kept on the node (engines/compile_cache.py)
  llama.cpp cold       llama-server, its GGUF fetched from the mirror first; alone: the download, then the spawn
  llama.cpp warm       the same model started again from the node's cached copy; alone: the spawn
  vllm compile cold    (`--with-vllm`: minutes) a real CPU vLLM with torch.compile, an empty compile cache
  vllm compile warm    the same model started again, its compile cache kept

    .venv/bin/python bench/activation.py [--runs 3] [--wake-s 0.5] [--compile-s 2] [--with-vllm]

Prints one line per measurement and a table: p50 through llmgw, p50 alone, their difference and ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port, stop_process  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from llmgw.engines.llamacpp import find_llama_server  # noqa: E402
from llmgw.engines.selftest import default_cache, fetch_model  # noqa: E402
from tests.fleet import sim_spec  # noqa: E402
from tests.helpers import ControlPlane  # noqa: E402

LLAMA_ARGS = ["--ctx-size", "512", "--parallel", "1"]
SIM = ["--tokens-per-second", "0"]
IDLE_S = 3  # on-demand models stop after this long idle, so the next request starts them again
LOAD_WAIT_S = 1800


def med(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token(base: str, model: str, headers: dict | None = None) -> float:
    """Seconds from sending a streamed chat request to its first `data:` line."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    with httpx.Client(timeout=LOAD_WAIT_S) as c, \
            c.stream("POST", base + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - t0
    raise RuntimeError(f"{model}: no data line")


def wait_health(base: str, proc: subprocess.Popen, timeout_s: float = LOAD_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}")
            try:
                if c.get(base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.005)
    raise RuntimeError(f"{base} not healthy after {timeout_s}s")


def spawn_to_first_token(argv: list[str], p: int, env: dict | None = None, model: str = "m") -> float:
    """Spawn an engine listening on port `p`, wait for /health 200, send the request: seconds to its first token."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    try:
        wait_health(f"http://127.0.0.1:{p}", proc)
        first_token(f"http://127.0.0.1:{p}", model)
        return time.perf_counter() - t0
    finally:
        stop_process(proc, grace_s=30)


def wait_status(cp: ControlPlane, model: str, status: str, timeout_s: float = 120) -> None:
    """Until `model` has a replica in `status` and, for "stopped", none holding or starting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = [r for r in cp.replicas() if r["model"] == model]
        live = [r for r in reps if r["status"] not in ("stopped", "failed", "lost")]
        if status == "stopped" and reps and not live:
            return
        if status != "stopped" and any(r["status"] == status for r in live):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{model}: no replica {status} after {timeout_s}s: {cp.replicas()}")


def on_demand(name: str, profile: dict, **scaling) -> dict:
    return {"name": name, "scaling": {"min": 0, "max": 1, "idle_timeout": IDLE_S, "load_wait": LOAD_WAIT_S, **scaling},
            "profiles": [profile]}


# ---- rungs: each returns {rung: (through llmgw [s], alone [s])} ---------------------------------------------

def sim_wake(cp: ControlPlane, runs: int, wake_s: float) -> dict[str, tuple[list[float], list[float]]]:
    args = SIM + ["--sleep-s", "0.1", "--wake-s", str(wake_s)]
    model = "act-sleepy"
    cp.apply({"models": [on_demand(model, {"engine": "sim", "args": args}, sleep_after=2, idle_timeout=3600)]})
    time.sleep(2)
    first_token(cp.gateway, model)  # the cold start; then it goes to sleep when idle
    through, alone = [], []
    for i in range(runs):
        wait_status(cp, model, "sleeping")
        # "sleeping" is marked as the sleep begins (out of routing), before its drain and the engine's own
        # sleep: a request then waits for that sleep to close, which is not what a wake costs.
        time.sleep(2)
        through.append(first_token(cp.gateway, model))
        print(f"sim wake {i}: through llmgw {through[-1] * 1000:.0f} ms", flush=True)
    p = port()
    proc = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--model", "m", "--port", str(p), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{p}"
        wait_health(base, proc)
        for i in range(runs):
            httpx.post(base + "/sleep?level=1", timeout=30).raise_for_status()
            t0 = time.perf_counter()
            httpx.post(base + "/wake_up", timeout=30).raise_for_status()
            first_token(base, "m")
            alone.append(time.perf_counter() - t0)
            print(f"sim wake {i}: alone {alone[-1] * 1000:.0f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    cp.apply({"models": []})
    return {f"sim wake (wake {wake_s * 1000:.0f} ms)": (through, alone)}


def restart_pair(cp: ControlPlane, model: str) -> tuple[float, float]:
    """(cold, warm): the model's first start, then, once stopped idle, its second."""
    cold = first_token(cp.gateway, model)
    wait_status(cp, model, "stopped", 300)
    warm = first_token(cp.gateway, model)
    wait_status(cp, model, "stopped", 300)
    return cold, warm


def sim_compile(cp: ControlPlane, runs: int, compile_s: float) -> dict[str, tuple[list[float], list[float]]]:
    args = SIM + ["--compile-s", str(compile_s)]
    names = [f"act-compiled-{i}" for i in range(runs)]
    cp.apply({"models": [on_demand(n, {"engine": "sim", "args": args}) for n in names]})
    time.sleep(2)
    cold, warm, cold_alone, warm_alone = [], [], [], []
    for n in names:
        c, w = restart_pair(cp, n)
        cold.append(c)
        warm.append(w)
        with tempfile.TemporaryDirectory() as d:
            env = os.environ | {"LLMGW_SIM_COMPILE_DIR": d}
            for out in (cold_alone, warm_alone):
                p = port()
                out.append(spawn_to_first_token([sys.executable, "-m", "llmgw.engines.sim_server", "--model", "m",
                                                 "--port", str(p), *args], p, env))
        print(f"sim compile {n}: through llmgw cold {c * 1000:.0f} ms, warm {w * 1000:.0f} ms; alone cold "
              f"{cold_alone[-1] * 1000:.0f} ms, warm {warm_alone[-1] * 1000:.0f} ms", flush=True)
    cp.apply({"models": []})
    label = f"(compile {compile_s * 1000:.0f} ms)"
    return {f"sim compile cold {label}": (cold, cold_alone), f"sim compile warm {label}": (warm, warm_alone)}


def llamacpp(cp: ControlPlane, runs: int) -> dict[str, tuple[list[float], list[float]]]:
    binary = find_llama_server()
    gguf = fetch_model(default_cache())
    names = [f"act-smol-{i}" for i in range(runs)]
    for n in names:  # one file per run: each cold start fetches its own from the mirror
        shutil.copy(gguf, cp.mirror_dir / f"{n}.gguf")
    cp.apply({"models": [on_demand(n, {"engine": "llamacpp", "source": f"mirror:{n}.gguf", "memory_gb": 1,
                                       "args": LLAMA_ARGS}) for n in names]})
    time.sleep(2)
    cold, warm, cold_alone, warm_alone = [], [], [], []
    mirror = f"http://127.0.0.1:{cp.ports['mirror']}/files/"
    for n in names:
        c, w = restart_pair(cp, n)
        cold.append(c)
        warm.append(w)
        with tempfile.TemporaryDirectory() as d:
            local = Path(d) / f"{n}.gguf"
            p = port()
            argv = [binary, "--model", str(local), "--host", "127.0.0.1", "--port", str(p), "--alias", "m",
                    "--n-gpu-layers", "0", *LLAMA_ARGS]
            t0 = time.perf_counter()
            with httpx.Client(timeout=300) as h, h.stream("GET", mirror + f"{n}.gguf") as r, open(local, "wb") as f:
                r.raise_for_status()
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
            fetched = time.perf_counter() - t0
            cold_alone.append(fetched + spawn_to_first_token(argv, p))
            warm_alone.append(spawn_to_first_token(argv, p))
        print(f"llama.cpp {n}: through llmgw cold {c * 1000:.0f} ms, warm {w * 1000:.0f} ms; alone cold "
              f"{cold_alone[-1] * 1000:.0f} ms (download {fetched * 1000:.0f}), warm {warm_alone[-1] * 1000:.0f} ms",
              flush=True)
    cp.apply({"models": []})
    return {"llama.cpp cold (from the mirror)": (cold, cold_alone),
            "llama.cpp warm (local copy)": (warm, warm_alone)}


def vllm(cp: ControlPlane, vllm_exe: str, model_dir: Path) -> dict[str, tuple[list[float], list[float]]]:
    from vllm_compile import ARGS, serve

    shutil.copytree(model_dir, cp.mirror_dir / "act-smol-hf")
    n = "act-vllm"
    cp.apply({"models": [on_demand(n, {"engine": "vllm", "device": "cpu", "source": "mirror:act-smol-hf/",
                                       "memory_gb": 4, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "args": ARGS,
                                       "start_timeout": LOAD_WAIT_S})]})
    time.sleep(2)
    c, w = restart_pair(cp, n)
    print(f"vllm: through llmgw cold {c:.1f} s, warm {w:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(tempfile.gettempdir())  # the agent's engines share /tmp (torch's precompiled header is there)
        aot = {"VLLM_USE_AOT_COMPILE": "0"}  # as the adapter sets it for a CPU profile with a compile cache
        runs = [serve(vllm_exe, model_dir, Path(d) / "cache", tmp, [], Path(d) / f"{k}.log", aot) for k in ("c", "w")]
    ca, wa = (r["healthy_s"] + r["first_token_s"] for r in runs)
    print(f"vllm: alone cold {ca:.1f} s, warm {wa:.1f} s", flush=True)
    cp.apply({"models": []})
    return {"vllm compile cold": ([c], [ca]), "vllm compile warm": ([w], [wa])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--wake-s", type=float, default=0.5, help="the sim engine's wake time")
    ap.add_argument("--compile-s", type=float, default=2.0, help="the sim engine's compile time on a cold cache")
    ap.add_argument("--with-vllm", action="store_true", help="also a real CPU vLLM, cold and warm (minutes)")
    ap.add_argument("--only", help="comma-separated rungs to run: wake, compile, llamacpp, vllm")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else {"wake", "compile", "llamacpp", "vllm"}
    extra_env = {}
    vllm_exe = model_dir = None
    if args.with_vllm and "vllm" in only:
        from llmgw.engines.vllm import find_vllm
        from llmgw.engines.vllm_selftest import converted_model

        vllm_exe = find_vllm(None)
        if vllm_exe is None:
            sys.exit("--with-vllm: vLLM is not installed (scripts/setup --with vllm)")
        model_dir = converted_model(Path(vllm_exe).parent / "python")
        extra_env["LLMGW_VLLM"] = vllm_exe
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-activation-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "pg.log", database="bench", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log", namespaces=["bench"])
    cp = None
    results: dict[str, tuple[list[float], list[float]]] = {}
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_TEMPORAL_NAMESPACE="bench",
                          LLMGW_RECONCILE_INTERVAL_S="1", LLMGW_LOAD_WAIT_S=str(LOAD_WAIT_S), **extra_env)
        cp.mirror_dir.mkdir(parents=True, exist_ok=True)
        cp.start(mirror=True)
        cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=256))
        cp.wait_nodes("n1")
        if "wake" in only:
            results |= sim_wake(cp, args.runs, args.wake_s)
        if "compile" in only:
            results |= sim_compile(cp, args.runs, args.compile_s)
        if "llamacpp" in only:
            if find_llama_server() is None:
                print("llama.cpp: llama-server is not installed (scripts/setup builds it); skipped")
            else:
                results |= llamacpp(cp, args.runs)
        if vllm_exe is not None and model_dir is not None:
            results |= vllm(cp, vllm_exe, model_dir)
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'rung':<36}{'through llmgw':>14}{'alone':>12}{'llmgw adds':>12}{'ratio':>8}   (p50, ms)")
    for rung, (through, alone) in results.items():
        t, a = med(through), med(alone)
        print(f"{rung:<36}{t * 1000:>14.0f}{a * 1000:>12.0f}{(t - a) * 1000:>12.0f}{t / a:>8.2f}")
    print(f"\n{datetime.now():%Y-%m-%d %H:%M}, {args.runs} runs per rung (vLLM: 1), load average "
          f"{open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
