"""Compile and kernel caches, kept on the node per key (issue 39, item 3).

An engine's compile artifacts (vLLM: torch.compile/Inductor graphs, Triton kernels, under its cache root)
depend on what was compiled and for what: the key is (engine, engine version, weights, tp, pp, accelerator
kind). Each key gets a directory `<cache_dir>/.compile/<name>`: hidden, so the weights' scans (inventory,
reclaim of weights, the fetcher) never count or serve it as weights. An engine is pointed at it through its
environment (`EngineAdapter.compile_env`):

- vLLM: `VLLM_CACHE_ROOT`. vLLM (0.32, `compilation/backends.py`, `compiler_interface.py`) puts its
  torch.compile cache under it (`torch_compile_cache/<hash>/`) and, when it compiles, sets
  `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR` to directories beside that cache itself. Its `<hash>`
  covers vLLM's config, environment, code and the compiler's own factors, so a key here that fails to
  split two builds costs a compile, never a wrong artifact.
- SGLang: `SGLANG_CACHE_DIR` (its DeepGEMM, CuTe and JIT caches) and, as SGLang's own
  `redirect_third_party_caches` sets them beneath it (releases of 2026; older ones leave them at torch's and
  Triton's defaults), `TRITON_CACHE_DIR` and `TORCHINDUCTOR_CACHE_DIR` (used by `--enable-torch-compile`).
- llama.cpp: none (its kernels are built ahead; the CPU and CUDA builds keep nothing at run time).
- sim: `LLMGW_SIM_COMPILE_DIR`, where its `--compile-s` cold-start delay leaves a mark a later start skips.

The weights component is the weights' cache name when they are in the node's cache (a hash of the source,
`weights/naming.py`), else the source as given (a model id, an operator's path).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

COMPILE_DIR = ".compile"  # under the node's cache dir; hidden: never weights
PART_MAX = 40  # characters of each readable part of a name; the digest covers the whole value


def slug(text: str) -> str:
    """`text` as one path component's readable part: lower case `[a-z0-9._-]`, no leading dot or dash, at
    most PART_MAX characters; "x" when nothing is left. Not unique: a name's digest is."""
    s = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip(".-")[:PART_MAX].strip(".-")
    return s or "x"


@dataclass(frozen=True)
class CompileKey:
    """What an engine's compile artifacts depend on. `accelerator` is "cpu" or the GPUs' model name."""

    engine: str
    engine_version: str
    weights: str
    tp: int = 1
    pp: int = 1
    accelerator: str = "cpu"

    @property
    def digest(self) -> str:
        """sha256 of every component (as JSON), 16 hex digits: two keys share it only if they are equal."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """The key's directory name: readable parts, then the digest, e.g.
        `vllm-0.32.0-cpu-tp1-pp1-cpu-3f9a...`. One path component (no `/`, never `.` or `..`, no leading dot)
        whatever the components hold, under 255 bytes."""
        return (f"{slug(self.engine)}-{slug(self.engine_version)}-tp{int(self.tp)}-pp{int(self.pp)}-"
                f"{slug(self.accelerator)}-{self.digest}")

    def to_json(self) -> dict:
        return asdict(self)


def weights_identity(cache_dir: Path, weights_path: str | None) -> str:
    """The weights component of a key: the cache entry's name for weights in `cache_dir` (a file in a version
    directory names the directory), else `weights_path` as given ("" for none)."""
    if not weights_path:
        return ""
    try:
        rel = Path(weights_path).resolve().relative_to(cache_dir.resolve())
    except (ValueError, OSError):
        return weights_path
    return rel.parts[0] if rel.parts else weights_path


def torch_cache_env(directory: str) -> dict[str, str]:
    """Inductor's and Triton's caches beneath `directory` (what vLLM and SGLang leave at torch's defaults
    unless told)."""
    return {"TORCHINDUCTOR_CACHE_DIR": f"{directory}/inductor", "TRITON_CACHE_DIR": f"{directory}/triton"}


def compile_root(cache_dir: Path) -> Path:
    return cache_dir / COMPILE_DIR


def dist_version(python: str | None, dist: str) -> str:
    """The version of distribution `dist` installed for `python` (its metadata; `dist` is not imported, so
    this takes a fraction of a second even for vLLM or SGLang); "" when it cannot tell."""
    if not python:
        return ""
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip()[:100] if proc.returncode == 0 else ""


def script_python(script: str | None) -> str | None:
    """The interpreter of a Python entry-point script (`#!/venv/bin/python`), or None (not a script)."""
    if not script:
        return None
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return parts[0] if parts and "python" in Path(parts[0]).name else None
