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
