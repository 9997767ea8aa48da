"""A real vLLM (its CPU build) started alone, cold and warm compile cache (issue 39, item 3).

Spawns `vllm serve` on the converted test model (tests/test_vllm_real.py's flags) and times spawn -> /health
200, then one request -> first token, for:
  1. `--optimization-level 0` (no torch.compile), a fresh cache root: the reference;
  2. torch.compile on (vLLM's default level), an empty cache root: cold;
  3. the same again with the cache root the cold run filled: warm.
Each run gets the variables llmgw gives a shard (`VllmAdapter.compile_env`: `VLLM_CACHE_ROOT` and Inductor's
and Triton's caches beneath it; engines/compile_cache.py) and its own `TMPDIR`, so what vLLM writes outside
them (torch's default `$TMPDIR/torchinductor_$USER`) shows.

    .venv/bin/python bench/vllm_compile.py [--runs O0,cold,warm] [--shared-tmp] [--env K=V ...] [--keep DIR]

`--shared-tmp`: every run gets the same `TMPDIR`, as the engines of one node share `/tmp` (torch keeps its
precompiled header there, `$TMPDIR/torchinductor_$USER/precompiled_headers`, whatever its cache variables
say). `--env`: a variable for every run (e.g. `VLLM_USE_AOT_COMPILE=0`).

Slow: the cold compile is minutes on two shared cores. Prints one line per run and a table at the end.
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from llmgw.dev.procs import stop_process  # noqa: E402
from llmgw.engines.vllm import VllmAdapter, find_vllm  # noqa: E402
from llmgw.engines.vllm_selftest import converted_model  # noqa: E402

ARGS = ["--max-model-len", "1024", "--dtype", "bfloat16"]  # tests/test_vllm_real.py, without -O0
START_S = 1800


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def du(path: Path) -> tuple[int, int]:
    """(files, bytes) under `path`."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def first_token_s(base: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with httpx.Client(timeout=300) as c, c.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - t0
    raise RuntimeError("no data line")


def serve(vllm: str, model: Path, cache_root: Path, tmp: Path, extra: list[str], log: Path,
          more_env: dict[str, str]) -> dict:
    """One start: seconds spawn -> /health 200 and request -> first token; the process is stopped after."""
    port = free_port()
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env |= VllmAdapter(vllm).compile_env(str(cache_root))  # what llmgw gives a shard of this key
    env |= {"TMPDIR": str(tmp), "VLLM_CPU_KVCACHE_SPACE": "1"} | more_env
    argv = [vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
            *ARGS, *extra]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client() as c:
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"vllm exited {p.returncode}: {log.read_text()[-3000:]}")
                if time.perf_counter() - t0 > START_S:
                    raise RuntimeError(f"vllm not healthy after {START_S}s")
                try:
                    if c.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        healthy = time.perf_counter() - t0
        ttft = first_token_s(f"http://127.0.0.1:{port}", "m")
        return {"healthy_s": healthy, "first_token_s": ttft}
    finally:
        stop_process(p, grace_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="O0,cold,warm", help="which runs, in order (O0, cold, warm)")
    ap.add_argument("--keep", type=Path, help="keep the cache roots and logs here")
    ap.add_argument("--shared-tmp", action="store_true", help="one TMPDIR for every run, as on a node")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="a variable for every run")
    args = ap.parse_args()
    more_env = dict(kv.split("=", 1) for kv in args.env)
    vllm = find_vllm(None)
    if vllm is None:
        sys.exit("vLLM is not installed (scripts/setup --with vllm)")
    model = converted_model(Path(vllm).parent / "python")
    root = args.keep or Path(tempfile.mkdtemp(prefix="llmgw-bench-vllm-compile-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for run in args.runs.split(","):
            cache = root / ("cache-O0" if run == "O0" else "cache")  # warm reuses the cold run's root
            tmp = root / ("tmp" if args.shared_tmp else f"tmp-{run}")
            tmp.mkdir(exist_ok=True)
            before = du(cache)
            r = serve(vllm, model, cache, tmp, ["--optimization-level", "0"] if run == "O0" else [],
                      root / f"{run}.log", more_env)
            files, size = du(cache)
            tfiles, tsize = du(tmp)
            r |= {"run": run, "cache": f"{before[0]} -> {files} files, {size / 1e6:.1f} MB",
                  "outside": f"{tfiles} files, {tsize / 1e6:.1f} MB"}
            rows.append(r)
            print(f"{run}: healthy after {r['healthy_s']:.1f} s, first token {r['first_token_s'] * 1000:.0f} ms; "
                  f"cache root {r['cache']}; under TMPDIR {r['outside']}", flush=True)
        print(f"\n{'run':<8}{'spawn->/health':>16}{'first token':>14}  cache root (before -> after)      under TMPDIR")
        for r in rows:
            print(f"{r['run']:<8}{r['healthy_s']:>14.1f} s{r['first_token_s'] * 1000:>11.0f} ms  {r['cache']:<32}  "
                  f"{r['outside']}")
        print(f"\nload average {open('/proc/loadavg').read().split()[0]}, {time.strftime('%Y-%m-%d %H:%M')}, "
              f"TMPDIR {'shared' if args.shared_tmp else 'per run'}, env {more_env or 'default'}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
