"""Small process helpers shared by the dev stack and the tests: free ports, waiting, stopping groups."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil


_HANDED_OUT: set[int] = set()  # ports free_port has returned in this process
# Where free_port picks, below Linux's ephemeral range (32768-60999). Test processes running side by side
# (pytest-xdist workers) each take a slice of it (tests/conftest.py), so that a port one of them let go (a
# server it stops and starts again on the same port) is never handed to the other meanwhile.
PORT_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, picked below Linux's ephemeral range (32768-60999), so that the
    outgoing connections every test makes cannot take it between this check and the server's bind. A port
    is not handed out twice by one process: a caller picking several before it binds any would otherwise
    get the same one twice now and then (seen in CI: the node's metrics port was Temporal UI's)."""
    import random

    low, high = PORT_RANGE
    if len(_HANDED_OUT) > (high - low) // 2:  # half the range: the oldest picks have long been bound or let go
        _HANDED_OUT.clear()
    for _ in range(200):
        port = random.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the low range is crowded: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "service") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(port):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout_s:.0f}s")


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Signal a child's process group (it was started with start_new_session), escalate to SIGKILL."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return proc.poll()
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait(5)


def kill_pid_file(path: Path, match: str, grace_s: float = 5.0) -> bool:
    """Terminate the process named in `path` if it is alive and its command line contains `match`."""
    try:
        pid = int(path.read_text().split()[0])
        p = psutil.Process(pid)
        if match not in " ".join(p.cmdline()):
            return False
    except (OSError, ValueError, IndexError, psutil.Error):
        path.unlink(missing_ok=True)
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        p.terminate()
    try:
        p.wait(grace_s)
    except psutil.TimeoutExpired:
        p.kill()
    path.unlink(missing_ok=True)
    return True
