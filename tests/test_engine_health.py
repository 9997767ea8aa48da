"""A Ready engine that stops answering while its process lives on (frozen with SIGSTOP here; a hung driver
or a deadlock on a GPU) is found by the node's liveness checks (node/health.py), reported failed with
the cause, stopped, and replaced: before, it stayed Ready and every request routed to it waited out the
gateway's upstream timeout. Through a real control plane, agent and sim engines, with the checks scaled
down (every 0.5 s, 3 in a row)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.integration

ONE = {"models": [{"name": "one", "scaling": {"min": 1, "max": 1},
                   "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]}]}


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_frozen_engine_is_failed_with_the_cause_stopped_and_replaced(control_plane):
    cp = control_plane.start()
    cp.agent("n1", LLMGW_ENGINE_PROBE_INTERVAL_S="0.5", LLMGW_ENGINE_PROBE_FAILURES="3")
    assert cp.apply(ONE).status_code == 200
    [rep] = cp.wait_replicas("one", timeout_s=60)
    pid = cp.shard_pid("n1", f"{rep['id']}-r0")
    body = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    # Checked every 0.5 s for 3 s: a healthy engine is never taken for a frozen one.
    time.sleep(3)
    assert not gone(pid) and next(r for r in cp.replicas() if r["id"] == rep["id"])["status"] == "ready"

    os.kill(pid, signal.SIGSTOP)
    try:
        failed = wait_until(lambda: next((r for r in cp.replicas() if r["id"] == rep["id"]
                                          and r["status"] == "failed"), None),
                            timeout_s=20, what="the frozen engine's replica failed", why=cp.logs)
        assert "did not answer 3 health checks in a row" in failed["failure"], failed
        wait_until(lambda: gone(pid), timeout_s=10, what="the frozen engine stopped")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)
    [new] = cp.wait_replicas("one", exclude={rep["id"]}, timeout_s=60)
    assert cp.shard_pid("n1", f"{new['id']}-r0") != pid
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_an_engine_over_its_declared_host_memory_is_failed_with_what_it_used_and_stopped(control_plane):
    # llama-server with `--ctx-size 999999999` on a profile of memory_gb 1 grew to 10 GB while it loaded.
    # The sim engine (a Python process, tens of MiB) is held to 0.01 GiB here: over it from the start.
    cp = control_plane.start()
    cp.agent("n1", LLMGW_ENGINE_PROBE_INTERVAL_S="0.5", LLMGW_ENGINE_PROBE_FAILURES="3")
    assert cp.apply({"models": [{"name": "greedy", "scaling": {"min": 1, "max": 1}, "profiles": [
        {"engine": "sim", "memory_gb": 0.01, "args": ["--tokens-per-second", "0"]}]}]}).status_code == 200
    failed = wait_until(lambda: next((r for r in cp.replicas() if r["model"] == "greedy" and r["status"] == "failed"),
                                     None), timeout_s=30, what="the greedy engine's replica failed", why=cp.logs)
    assert "GiB of host memory, over 1.5 x its profile's memory_gb (0.01)" in failed["failure"], failed
    wait_until(lambda: not (cp.state / "shards" / "n1" / f"{failed['id']}-r0.json").exists(), timeout_s=10,
               what="the greedy engine stopped (its spec file gone)")


def test_a_frozen_engine_is_stopped_at_once_though_the_control_plane_cannot_be_told(control_plane):
    """The control plane's node API does not answer (its server frozen with SIGSTOP: connections are taken
    and never answered) when an engine freezes. The node stopped the engine only after its report had been
    retried, 10 s a try (about a minute), and checked no other engine meanwhile: a safety action of the
    node now waits on nothing."""
    cp = control_plane.start()
    cp.agent("n1", LLMGW_ENGINE_PROBE_INTERVAL_S="0.5", LLMGW_ENGINE_PROBE_FAILURES="3")
    assert cp.apply(ONE).status_code == 200
    [rep] = cp.wait_replicas("one", timeout_s=60)
    pid = cp.shard_pid("n1", f"{rep['id']}-r0")
    server = psutil.Process(next(p for p in cp.procs if p.name == "server").proc.pid)
    frozen = [server, *server.children(recursive=True)]  # the gateway and its node-API child
    for p in frozen:
        p.suspend()
    os.kill(pid, signal.SIGSTOP)
    try:
        # 3 checks of 0.5 s (each waits up to its timeout), then the stop's grace: well under the report's minute.
        wait_until(lambda: gone(pid), timeout_s=25, what="the frozen engine stopped with nobody to tell")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)
        for p in frozen:
            p.resume()
