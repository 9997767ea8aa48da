"""A real vLLM (its CPU build, `scripts/setup --with vllm`) behind llmgw, against `vllm serve` alone, in the
same run (issue 35):

1. **On demand**: request -> first token for a model with no replica (scaling min 0) through the gateway,
   which places it, fetches its weights from the mirror (a node cache cleared each run), launches vLLM and
   holds the request until it is ready; against `vllm serve` started by hand on the same weights, timed
   from spawn to its first token. Interleaved: llmgw, alone, llmgw, alone, ...
2. **Warm**: the p50 of a short chat completion straight to vLLM (with its key) and through the gateway,
   one request at a time, interleaved; the gateway's added time and the ratio.

    .venv/bin/python bench/engines.py [--runs 2] [--warm 60]

Each vLLM start takes one to three minutes on two shared cores (`--optimization-level 0`: no
torch.compile warm-up), so a run of 2 takes about ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.db.migrate import upgrade  # noqa: E402
from llmgw.dev.postgres import EmbeddedPostgres  # noqa: E402
from llmgw.dev.procs import free_port  # noqa: E402
from llmgw.dev.temporal_server import TemporalDevServer  # noqa: E402
from llmgw.engines.vllm import find_vllm  # noqa: E402
from llmgw.engines.vllm_selftest import converted_model  # noqa: E402
from tests.helpers import ControlPlane, wait_until  # noqa: E402

MODEL = "smol-vllm"
ARGS = ["--max-model-len", "1024", "--dtype", "bfloat16", "--optimization-level", "0"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}


def first_token(url: str, headers: dict | None = None, timeout_s: float = 900) -> float:
    """Seconds from now to the first content chunk of a streamed chat completion at `url`."""
    start = time.monotonic()
    with httpx.Client(timeout=timeout_s) as c, c.stream("POST", url + "/v1/chat/completions", headers=headers,
                                                        json=BODY | {"stream": True}) as r:
        r.raise_for_status()
        seen = []
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - start
            seen.append(line)
    raise RuntimeError(f"no token after {time.monotonic() - start:.0f} s: {' | '.join(seen)[-600:]}")


def alone(exe: str, model_dir: Path, log: Path) -> float:
    """`vllm serve` by hand: spawn -> first token (it answers 503/refuses until ready: poll /health)."""
    port, key = free_port(), "bench"
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen([exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                 "--served-model-name", MODEL, *ARGS], stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | ENV | {"VLLM_API_KEY": key, "CUDA_VISIBLE_DEVICES": ""},
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(base), timeout_s=900, interval_s=0.2, what="vllm alone healthy")
        first_token(base, {"Authorization": f"Bearer {key}"})
        return time.monotonic() - start
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def catalog(min_replicas: int) -> dict:
    return {"models": [{"name": MODEL, "scaling": {"min": min_replicas, "max": 1, "idle_timeout": 3600, "load_wait": 900},
                        "profiles": [{"engine": "vllm", "device": "cpu", "source": "mirror:smollm2-hf/",
                                      "memory_gb": 4, "env": ENV, "args": ARGS, "start_timeout": 900}]}]}


def on_demand(cp: ControlPlane) -> float:
    """Request -> first token through the gateway for a model with no replica; then the model is removed."""
    shutil.rmtree(cp.state / "cache", ignore_errors=True)  # the node fetches the weights again (before the
    assert cp.apply(catalog(0)).status_code == 200          # apply: a replica may start on recent demand)
    took = first_token(cp.gateway)
    assert cp.apply({"models": []}).status_code == 200
    wait_until(lambda: not cp.replicas(all=False), timeout_s=120, what="the replica stopped")
    return took


def warm(cp: ControlPlane, n: int) -> tuple[float, float]:
    assert cp.apply(catalog(1)).status_code == 200
    [rep] = cp.wait_replicas(MODEL, timeout_s=900)
    spec = json.loads((cp.state / "shards" / "cpu-1" / f"{rep['id']}-r0.json").read_text())
    direct_h = {"Authorization": f"Bearer {spec['api_key']}"}
    direct, through = [], []
    with httpx.Client(timeout=120) as c:
        for url, h in ((spec["endpoint"], direct_h), (cp.gateway, None)):  # warm both paths' connections
            c.post(url + "/v1/chat/completions", headers=h, json=BODY).raise_for_status()
        for _ in range(n):
            for url, h, out in ((spec["endpoint"], direct_h, direct), (cp.gateway, None, through)):
                t = time.monotonic()
                c.post(url + "/v1/chat/completions", headers=h, json=BODY).raise_for_status()
                out.append(time.monotonic() - t)
    return statistics.median(direct), statistics.median(through)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="on-demand starts of each kind")
    ap.add_argument("--warm", type=int, default=60, help="warm requests of each kind")
    args = ap.parse_args()
    exe = find_vllm(os.environ.get("LLMGW_VLLM"))
    if exe is None:
        sys.exit("vLLM is not installed: scripts/setup --with vllm")
    model_dir = converted_model(Path(exe).parent / "python")
    root = Path(tempfile.mkdtemp(prefix="llmgw-engines-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", durable=False)
    temporal = TemporalDevServer(free_port(), None, None, root / "temporal.log")
    cp = None
    ok = False
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        cp = ControlPlane(root, pg.url, temporal.address, LLMGW_VLLM=exe, LLMGW_LOAD_WAIT_S="900")
        shutil.copytree(model_dir, cp.mirror_dir / "smollm2-hf")
        cp.start(mirror=True)
        cp.agent("cpu-1")
        cp.wait_nodes("cpu-1")
        llmgw_s, alone_s = [], []
        for i in range(args.runs):
            llmgw_s.append(on_demand(cp))
            alone_s.append(alone(exe, model_dir, root / "vllm-alone.log"))
            print(f"run {i + 1}: on demand through llmgw {llmgw_s[-1]:.1f} s, vllm serve alone {alone_s[-1]:.1f} s",
                  file=sys.stderr)
        direct, through = warm(cp, args.warm)
        p50_l, p50_a = statistics.median(llmgw_s), statistics.median(alone_s)
        print(f"\nreal vLLM {Path(exe).parent.parent.name} (CPU build), SmolLM2-135M, {args.runs} run(s) each, "
              f"interleaved\n")
        print(f"{'request -> first token, no replica':40s} llmgw p50 {p50_l:7.1f} s   vllm alone p50 {p50_a:7.1f} s   "
              f"ratio {p50_l / p50_a:.2f}   added {p50_l - p50_a:+.1f} s")
        print(f"{'warm chat completion, 4 tokens':40s} gateway p50 {through * 1000:6.1f} ms  direct p50 "
              f"{direct * 1000:6.1f} ms   ratio {through / direct:.2f}   added {(through - direct) * 1000:+.1f} ms")
        ok = True
    finally:
        if cp is not None:
            cp.stop()
        temporal.stop()
        pg.stop()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"failed: logs kept in {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
