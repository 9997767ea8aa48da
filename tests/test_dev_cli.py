"""`llmgw dev` refuses to start when a port it needs is taken, naming the port and the setting that moves
it, before starting anything."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmgw.dev.procs import free_port


def test_taken_port_is_named_with_the_setting_that_moves_it():
    state = Path(tempfile.mkdtemp(prefix="llmgw-test-dev-"))
    ports = {k: free_port() for k in ("gateway", "admin", "mirror", "node_api", "temporal", "temporal_ui", "postgres")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update({"LLMGW_STATE_DIR": str(state), "LLMGW_AGENT_METRICS_PORT": "0", "LLMGW_CONTROL_METRICS_PORT": "0",
                **{f"LLMGW_{k.upper()}_PORT": str(v) for k, v in ports.items()}})
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", ports["gateway"]))
        blocker.listen()
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "llmgw", "dev"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode != 0
        assert f"port {ports['gateway']} (gateway) is in use: set LLMGW_GATEWAY_PORT to a free port" in r.stderr
        assert time.monotonic() - started < 20
        assert not (state / "postgres").exists()  # nothing was started
        assert "stopping" not in r.stdout + r.stderr and "stopped." not in r.stdout + r.stderr  # so nothing stops
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_free_port_never_hands_out_one_port_twice():
    """Nine ports picked at once for `llmgw dev` (none bound yet) once held the same one twice, and the
    agent's metrics server could not bind. 2000 picks of 12000 would repeat about 160 times by chance."""
    picked = [free_port() for _ in range(2000)]
    assert len(set(picked)) == len(picked)


def test_mirror_add_beside_a_dev_on_another_state_directory_adds_to_that_dev(tmp_path, monkeypatch):
    """`LLMGW_STATE_DIR=X llmgw dev` in one terminal, `llmgw mirror add FILE` in another without the variable:
    the file went to ~/.local/share/llmgw/mirror, where that dev never looks (issue 44). It goes to X's
    mirror now, said on stderr; a state directory the user names still wins; two such devs are a question."""
    from llmgw.config import Settings
    from llmgw.dev.stack import DevStack

    data = tmp_path / "data"  # XDG_DATA_HOME: the default state directory is data/llmgw
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"w" * 64)

    def add(**extra):
        return subprocess.run([sys.executable, "-m", "llmgw", "mirror", "add", str(model)],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)

    devs = [DevStack(Settings(state_dir=tmp_path / name), echo=lambda _: None) for name in ("srv", "other")]
    devs[0].lock()  # as `llmgw dev` takes it first thing
    try:
        out = add()
        assert out.returncode == 0 and (tmp_path / "srv" / "mirror" / "m.gguf").exists(), out
        assert f"the running `llmgw dev` keeps its state in {tmp_path / 'srv'}" in out.stderr, out
        assert not (data / "llmgw" / "mirror").exists()

        out = add(LLMGW_STATE_DIR=str(tmp_path / "mine"))  # named: used, whatever runs
        assert out.returncode == 0 and (tmp_path / "mine" / "mirror" / "m.gguf").exists() and not out.stderr, out

        devs[1].lock()
        out = add()
        assert out.returncode == 2 and "2 `llmgw dev` run on other state directories" in out.stderr, out
        assert "set LLMGW_STATE_DIR" in out.stderr and "Traceback" not in out.stderr
        assert not (tmp_path / "other" / "mirror").exists()
    finally:
        for d in devs:
            d.unlock()
    # Stopped (or killed: a lock is held only by a live process), no dev is followed: the default again.
    devs[0].lock()
    os.close(devs[0]._lock_fd)  # as if killed: the lock goes with the process, the pointer stays
    devs[0]._lock_fd = None
    out = add()
    assert out.returncode == 0 and (data / "llmgw" / "mirror" / "m.gguf").exists() and not out.stderr, out
    assert list((data / "llmgw" / "run" / "devs").iterdir()) == []  # the dead dev's pointer was dropped
