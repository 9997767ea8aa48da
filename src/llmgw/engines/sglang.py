"""Adapter for SGLang (`python -m sglang.launch_server`).

`--model-path PATH --served-model-name NAME --host H --port P --tp TP --pp-size PP --enable-metrics` +
profile args. SGLang's `--tp` is the total tensor-parallel size across every node. Multi-node, every shard
runs the same command with `--nnodes N --node-rank R --dist-init-addr RANK0:PORT` (the rendezvous
address); only rank 0 serves HTTP, and it becomes ready only once every rank has joined, so rank 0's
readiness is the proof that the workers joined (the default `joined`).

Reachability (issue 11): SGLang reads its API key from no environment variable, so rank 0 gets the engine
key as `--api-key` (visible in the process list to other users of the node; the node worker's logs show
it redacted). SGLang then refuses every request without it except `/health` and `/metrics`. The
rendezvous (`--dist-init-addr`) is the node's advertised address; NCCL's and Gloo's sockets are kept on
that address's interface (`launch_env`). torch's TCPStore behind `--dist-init-addr` listens on every
interface whatever address it is given, which no flag changes: firewall the rendezvous port to the
fabric (docs/security.md).

Sleep (issue 39; not run here: SGLang needs a GPU): a shard launched able to sleep gets
`--enable-memory-saver`; `POST /release_memory_occupation` releases its weights and KV cache and
`POST /resume_memory_occupation` takes them back, both behind `--api-key` like every path but `/health` and
`/metrics`. SGLang has one level: what it releases is what vLLM's level 1 and 2 do together.
"""

from __future__ import annotations

import subprocess
import sys

import aiohttp

from llmgw.engines.base import (
    EngineAdapter, LaunchPlan, ShardSpec, auth_headers, launch_env, weights_argument,
)
from llmgw.engines.compile_cache import dist_version, torch_cache_env
from llmgw.engines.metrics_text import scrape_gauge


def has_module(python: str, module: str) -> bool:
    """Whether `python` can import `module`, without importing it (SGLang takes seconds to import)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class SglangAdapter(EngineAdapter):
    name = "sglang"
    sleeps = True
    sleep_path = "/release_memory_occupation"
    wake_path = "/resume_memory_occupation"

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable
        self._version: str | None = None

    def engine_version(self) -> str:
        if self._version is None:
            self._version = dist_version(self.python, "sglang")
        return self._version

    def compile_env(self, directory: str | None) -> dict[str, str]:
        # SGLANG_CACHE_DIR, and beneath it what SGLang's own `redirect_third_party_caches` sets (older releases
        # do not), as explicit values: they win over its defaults (engines/compile_cache.py).
        if not directory:
            return {}
        return {"SGLANG_CACHE_DIR": directory, **torch_cache_env(directory)}

    def executable(self) -> str:
        return f"{self.python} -m sglang.launch_server"

    def available(self) -> bool:
        return has_module(self.python, "sglang")

    def build(self, spec: ShardSpec) -> LaunchPlan:
        p = spec.profile
        model = weights_argument(spec, "SGLang needs a model id or a weights directory")
        # The worker's flags come after the profile's: argparse takes the last occurrence. Flags are written whole
        # (`--tp-size`, not the prefix `--tp` argparse expands while it is unambiguous: SGLang 0.5.23's parser).
        argv = [self.python, "-m", "sglang.launch_server", *p.args, "--model-path", model,
                "--served-model-name", spec.model, "--tp-size", str(p.tp), "--pp-size", str(p.pp), "--enable-metrics"]
        rz = spec.rendezvous
        if rz is not None:
            argv += ["--nnodes", str(rz.world_size), "--node-rank", str(spec.rank), "--dist-init-addr", rz.address]
        if not spec.is_worker:
            argv += ["--host", spec.host, "--port", str(spec.port)]
            if spec.api_key:
                argv += ["--api-key", spec.api_key]
        if spec.sleep_mode:
            argv += ["--enable-memory-saver"]
        endpoint = "" if spec.is_worker else f"http://{spec.host}:{spec.port}"
        return LaunchPlan(argv=argv, env=launch_env(spec, self.compile_env(spec.compile_dir)), endpoint=endpoint)

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> int | None:
        return await scrape_gauge(session, endpoint, "sglang:num_running_reqs", auth_headers(api_key))

    def _body(self, what: str) -> dict | None:
        return {}  # ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput: every tag
