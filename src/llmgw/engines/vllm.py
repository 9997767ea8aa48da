"""Adapter for vLLM (`vllm serve`), single node or multi-node with Ray.

Single node: `vllm serve MODEL --host H --port P --served-model-name NAME --tensor-parallel-size TP
--pipeline-parallel-size PP` + profile args. `MODEL` is the fetched weights directory or a bare model id,
passed untouched (seeds 000).

Multi-node (vLLM's documented recipe: a Ray cluster, then `vllm serve` on the head with
`--distributed-executor-backend ray`, TP × PP spanning every node's GPUs):
- the rendezvous address is the Ray head's GCS port on rank 0's node;
- each worker shard runs `ray start --address HEAD --node-ip-address H --num-gpus N --block`, wrapped by
  `llmgw.engines.ray_launch join`, which waits for the head to accept connections (workers launch
  before rank 0);
- rank 0 runs `llmgw.engines.ray_launch head`: `ray start --head --port P ... --block`, then, once
  `ray status` counts every node of the replica, `vllm serve ...` — so rank 0 becomes ready only when
  all workers have joined, which is the proof `joined` relies on.
All of a shard's processes share its process group: stopping the shard stops Ray and vLLM together.

Reachability (issue 11): the engine key goes in `VLLM_API_KEY` (vLLM refuses `/v1/*` without it). Every
`ray start` is given `--node-ip-address` = the node's advertised address, which recent Ray (2.50 and later,
ray-project/ray#55484 and #59852) binds its GCS, raylet, object manager and worker ports to instead of
0.0.0.0; the head runs without its dashboard (`--include-dashboard false`: the dashboard carries Ray's job
submission API, which runs code). Older Ray binds 0.0.0.0 whatever it is told: firewall its ports to the
fabric. NCCL's and Gloo's sockets are kept on the same interface (`launch_env`). See docs/security.md.

Sleep (issue 39; checked against vLLM 0.32): `POST /sleep?level=1|2`, `POST /wake_up` and `GET /is_sleeping`
exist only with `VLLM_SERVER_DEV_MODE=1`, and free GPU memory only with `--enable-sleep-mode` (a GPU
platform's; the CPU build refuses the flag, "Sleep mode is not supported on current platform", and its dev
endpoints only pause the scheduler: no memory is released, so the planner never puts a CPU vLLM to sleep).
Dev mode also opens `/collective_rpc` and more, and vLLM's key guards only `/v1` and a few other prefixes:
so a shard launched able to sleep (`ShardSpec.sleep_mode`) also loads `llmgw_vllm_guard.KeyEveryPath`
(`--middleware`, from `engines/vllm_guard/` put on its `PYTHONPATH`), which refuses every path without the
engine key. Level 1 (the default) keeps the weights in host memory, so a wake is a copy back, not a load.

LoRA (issue 40): a profile with `max_loras` is launched with `--enable-lora --max-loras N --max-lora-rank R`
(R: `max_lora_rank`, else vLLM's default 16) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, which opens
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (under `/v1`, so behind the engine key); the
gateway loads adapters there by demand (gateway/adapters.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import aiohttp

from llmgw.engines.base import (
    EngineAdapter, EngineError, LaunchPlan, ShardSpec, auth_headers, launch_env, weights_argument,
)
from llmgw.engines.compile_cache import dist_version, script_python, torch_cache_env
from llmgw.engines.metrics_text import scrape_gauge

GUARD_DIR = Path(__file__).resolve().parent / "vllm_guard"  # holds only llmgw_vllm_guard.py
GUARD = "llmgw_vllm_guard.KeyEveryPath"


def vllm_home() -> Path:
    """Where `scripts/setup --with vllm` puts vLLM's CPU build: `venv/` (vLLM in a venv of its own, never in
    llmgw's: it pins FastAPI, pydantic, starlette) and `models/` (the converted test model)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "vllm"


def find_vllm(configured: str | None = None) -> str | None:
    """The `vllm` executable: `LLMGW_VLLM`, else `vllm` on PATH, else the one `scripts/setup --with vllm`
    installed (`vllm_home()/venv/bin/vllm`)."""
    if configured:
        return configured
    found = shutil.which("vllm")
    if found:
        return found
    installed = vllm_home() / "venv" / "bin" / "vllm"
    return str(installed) if installed.exists() else None


class VllmAdapter(EngineAdapter):
    name = "vllm"
    sleeps = True
    sleep_path = "/sleep?level={level}"
    wake_path = "/wake_up"

    def __init__(self, vllm: str | None = None, ray: str | None = None):
        self.vllm = find_vllm(vllm)
        self.ray = ray or shutil.which("ray")
        self._version: str | None = None

    def engine_version(self) -> str:
        if self._version is None:
            self._version = dist_version(script_python(self.vllm), "vllm")
        return self._version

    def compile_env(self, directory: str | None) -> dict[str, str]:
        # Inductor's and Triton's too: vLLM moves them beside its compile cache only when that cache is on (its
        # AOT compile); otherwise torch's defaults under /tmp would hold them (engines/compile_cache.py).
        if not directory:
            return {}
        return {"VLLM_CACHE_ROOT": directory, **torch_cache_env(directory)}

    def available(self) -> bool:
        return self.vllm is not None

    def executable(self) -> str:
        return self.vllm or "none"

    def serve_argv(self, spec: ShardSpec, multi_node: bool) -> list[str]:
        p = spec.profile
        model = weights_argument(spec, "vLLM needs a model id or a weights directory")
        # The model is vLLM's positional argument; the worker's flags come after the profile's, so they win.
        argv = [self.vllm or "vllm", "serve", model, *p.args, "--host", spec.host, "--port", str(spec.port),
                "--served-model-name", spec.model, "--tensor-parallel-size", str(p.tp),
                "--pipeline-parallel-size", str(p.pp)]
        if multi_node:
            argv += ["--distributed-executor-backend", "ray"]
        if p.max_loras:
            argv += ["--enable-lora", "--max-loras", str(p.max_loras), "--max-lora-rank", str(p.lora_rank)]
        if spec.sleep_mode:
            argv += ["--middleware", GUARD]
            if p.gpus_per_shard:  # the CPU build refuses it (see the module's doc)
                argv += ["--enable-sleep-mode"]
        return argv

    @staticmethod
    def sleep_env(spec: ShardSpec) -> dict[str, str]:
        """The environment a shard able to sleep needs: the dev endpoints, and the guard importable."""
        if not spec.sleep_mode:
            return {}
        return {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(GUARD_DIR)}

    def build(self, spec: ShardSpec) -> LaunchPlan:
        if not self.vllm:
            raise EngineError("vLLM is not installed on this node; set LLMGW_VLLM to the `vllm` executable")
        rz = spec.rendezvous
        worker_env = {"VLLM_API_KEY": spec.api_key} if spec.api_key else {}
        worker_env |= self.sleep_env(spec) | self.compile_env(spec.compile_dir)
        if spec.compile_dir and spec.profile.device == "cpu":
            # The CPU build (0.32) cannot load its own AOT artifact ("'function' object has no attribute
            # 'finalize_loading'") and compiles again every start; its other path reuses Inductor's cache
            # (bench/README.md, "Compile caches and the activation ladder": 120 s cold, 43 s warm).
            worker_env["VLLM_USE_AOT_COMPILE"] = "0"
        if spec.profile.max_loras:
            worker_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if rz is not None:
            worker_env["VLLM_HOST_IP"] = spec.host
        env = launch_env(spec, worker_env)
        if rz is None:
            return LaunchPlan(argv=self.serve_argv(spec, False), env=env, endpoint=f"http://{spec.host}:{spec.port}")
        if not self.ray:
            raise EngineError("multi-node vLLM needs Ray on this node; set LLMGW_RAY to the `ray` executable")
        gpus = str(len(spec.gpus) or spec.profile.gpus_per_shard)
        launcher = [sys.executable, "-m", "llmgw.engines.ray_launch"]
        if spec.is_worker:
            argv = launcher + ["join", "--address", rz.address, "--"] + [
                self.ray, "start", "--address", rz.address, "--node-ip-address", spec.host, "--num-gpus", gpus, "--block"]
            return LaunchPlan(argv=argv, env=env, endpoint="")
        head_host, head_port = rz.address.rsplit(":", 1)
        argv = launcher + ["head", "--ray", self.ray, "--address", rz.address, "--nodes", str(rz.world_size), "--",
                           self.ray, "start", "--head", "--node-ip-address", head_host, "--port", head_port,
                           "--num-gpus", gpus, "--include-dashboard", "false", "--block", "--"] + self.serve_argv(spec, True)
        return LaunchPlan(argv=argv, env=env | {"RAY_ADDRESS": rz.address},
                          endpoint=f"http://{spec.host}:{spec.port}")

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> int | None:
        return await scrape_gauge(session, endpoint, "vllm:num_requests_running", auth_headers(api_key))
