"""Compile caches through the real path (issue 39, item 3): a control plane, a real node worker and sim engines
that "compile" on a cold cache (`--compile-s`) and skip it on a warm one, as vLLM does with its cache root.

The engine the agent launches gets the key's directory in its environment (read from the process itself), holds
its lock while it runs, and a later start of the same key is handed the same directory and starts warm; two
shards of one key at once never share a directory (the second gets a copy)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from llmgw.node.compile_dirs import held
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

MODEL = "compiled"


def catalog(n: int) -> dict:
    return {"models": [{"name": MODEL, "scaling": {"min": n, "max": n}, "profiles": [{"engine": "sim", "args": [
        "--tokens-per-second", "0", "--compile-s", "1"]}]}]}


def engines(cp) -> list[dict]:
    """The running sim engines of MODEL: pid, the compile directory in the process's own environment, its log."""
    out = []
    for r in cp.replicas():
        if r["model"] != MODEL or r["status"] != "ready":
            continue
        spec = json.loads((cp.state / "shards" / "node-a" / f"{r['id']}-r0.json").read_text())
        env = psutil.Process(spec["pid"]).environ()
        out.append({"pid": spec["pid"], "dir": env.get("LLMGW_SIM_COMPILE_DIR"),
                    "log": Path(spec["log_path"]).read_text(errors="replace")})
    return out


def test_an_engine_gets_its_keys_compile_directory_and_a_later_start_of_the_key_reuses_it(control_plane):
    cp = control_plane
    cp.start()
    cp.agent("node-a")
    cp.wait_nodes("node-a")
    compile_root = cp.state / "cache" / "node-a" / ".compile"

    assert cp.apply(catalog(1)).status_code == 200
    cp.wait_replicas(MODEL, timeout_s=60)
    [first] = engines(cp)
    d = Path(first["dir"] or "")
    assert d.parent == compile_root, (first["dir"], cp.logs())  # the key's directory, under the node's cache
    assert d.name.startswith("sim-") and "-tp1-pp1-cpu-" in d.name
    assert json.loads((d / "key.json").read_text())["engine"] == "sim"
    assert "compile cache cold" in first["log"], first["log"]
    assert held(d)  # the engine holds the key while it runs
    wait_until(lambda: any(p.name.startswith("sim-compiled-") for p in d.iterdir()), 10, 0.1, "the compile mark")
    assert (d / ".warm").exists()  # its shard became ready: its compile is done

    # Stopped: the key is free; started again: the same directory, warm.
    assert cp.apply(catalog(0)).status_code == 200
    cp.wait_replicas(MODEL, "stopped", timeout_s=60)
    wait_until(lambda: not psutil.pid_exists(first["pid"]) or psutil.Process(first["pid"]).status() == "zombie",
               10, 0.1, "the first engine gone")
    assert not held(d)
    assert cp.apply(catalog(1)).status_code == 200
    wait_until(lambda: engines(cp), 60, 0.3, "the second start ready")
    [second] = engines(cp)
    assert second["pid"] != first["pid"] and second["dir"] == str(d)
    assert "compile cache warm" in second["log"], second["log"]

    # Two shards of the key at once: the running one keeps the key's directory, the new one gets a copy of it
    # (warm, never the same directory: one writer per directory).
    assert cp.apply(catalog(2)).status_code == 200
    both = wait_until(lambda: e if len(e := engines(cp)) == 2 else None, 60, 0.3, "two replicas")
    dirs = {e["dir"] for e in both}
    assert len(dirs) == 2 and str(d) in dirs, dirs
    [scratch] = dirs - {str(d)}
    assert Path(scratch).parent == compile_root / ".scratch"
    assert all("compile cache warm" in e["log"] for e in both), [e["log"] for e in both]
