"""The fleet is authoritative about what runs, through the real node worker and node API (seeds 001):
a restarted worker adopts its engines without restarting them and traffic keeps flowing; a worker that
comes back reporting nothing makes its old replicas go away; an engine nobody can identify is stopped;
one that runs exactly what the catalog asks for is adopted even when the control plane had no record, and the
gateway reaches it with the engine key the node reports (issue 11)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from llmgw.engines.base import ShardSpec, new_api_key
from llmgw.engines.sim import SimAdapter
from llmgw.dev.procs import free_port
from llmgw.schemas.catalog import Profile
from llmgw.node.supervisor import Supervisor
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

PROFILE = {"engine": "sim", "args": ["--tokens-per-second", "0"]}
CATALOG = {"models": [{"name": "sim-a", "scaling": {"min": 1, "max": 1}, "profiles": [PROFILE]}]}


def chat_ok(cp) -> bool:
    try:
        r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=10,
                       json={"model": "sim-a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def spec_pid(cp, node: str, replica_id: str) -> int:
    return json.loads((cp.state / "shards" / node / f"{replica_id}-r0.json").read_text())["pid"]


def test_restarted_worker_adopts_running_engines_and_traffic_keeps_flowing(control_plane):
    cp = control_plane.start()
    agent = cp.agent("n1", stop_engines_on_exit=False)
    assert cp.apply(CATALOG).status_code == 200
    [rep] = cp.wait_replicas("sim-a")
    wait_until(lambda: chat_ok(cp), what="traffic")
    pid = spec_pid(cp, "n1", rep["id"])

    failures, done = [], threading.Event()

    def traffic():
        while not done.is_set():
            if not chat_ok(cp):
                failures.append(time.monotonic())
            time.sleep(0.05)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        agent.stop()  # SIGTERM: the worker exits, its engines keep running
        assert psutil.pid_exists(pid)
        time.sleep(1)
        new = cp.agent("n1", name="agent-n1-again", stop_engines_on_exit=False)
        wait_until(lambda: "registered node n1 (1 shard(s) running" in new.log(), timeout_s=30, what="re-registration")
        time.sleep(2)
    finally:
        done.set()
        t.join()
    assert failures == []
    assert spec_pid(cp, "n1", rep["id"]) == pid and psutil.pid_exists(pid)  # not restarted
    reps = [r for r in cp.replicas() if r["model"] == "sim-a"]
    assert [(r["id"], r["status"]) for r in reps] == [(rep["id"], "ready")]  # no second replica


def test_worker_back_with_nothing_makes_its_old_replicas_go_away(control_plane):
    cp = control_plane.start()
    agent = cp.agent("n1", stop_engines_on_exit=False)
    assert cp.apply(CATALOG).status_code == 200
    [rep] = cp.wait_replicas("sim-a")
    pid = spec_pid(cp, "n1", rep["id"])
    agent.kill()
    os.killpg(pid, signal.SIGKILL)  # the machine rebooted: nothing survives
    new = cp.agent("n1", name="agent-n1-again")
    wait_until(lambda: "registered node n1 (0 shard(s) running" in new.log(), timeout_s=30, what="registration")
    wait_until(lambda: any(r["id"] == rep["id"] and r["status"] == "lost" for r in cp.replicas()), timeout_s=10,
               what="old replica lost")
    [again] = cp.wait_replicas("sim-a", exclude={rep["id"]}, timeout_s=30)
    assert again["node_id"] == "n1"


def launch_by_hand(cp, node: str, replica_id: str, model: str, profile: Profile) -> tuple[int, str]:
    """Start an engine (with its key) and its spec file the way a previous worker would have left it.
    Returns (pid, endpoint)."""
    sup = Supervisor(cp.state / "shards" / node, cp.state / "logs" / node)
    spec = ShardSpec(shard_id=f"{replica_id}-r0", replica_id=replica_id, model=model, profile=profile, port=free_port(),
                     api_key=new_api_key())
    shard = sup.launch(spec, SimAdapter().build(spec))
    wait_until(lambda: _up(shard.endpoint, spec.api_key), what="hand-started engine")
    shard.state = "ready"
    sup.save(shard)
    return shard.pid, shard.endpoint


def _up(url: str, key: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    except httpx.HTTPError:
        return False


def test_unidentifiable_engine_is_stopped_and_identifiable_one_is_adopted(control_plane):
    cp = control_plane.start()
    assert cp.apply(CATALOG).status_code == 200
    stranger, _ = launch_by_hand(cp, "n1", "not-ours", "some-other-model", Profile(engine="sim"))
    ours, endpoint = launch_by_hand(cp, "n1", "lost-record", "sim-a", Profile.model_validate(PROFILE))
    # The engine refuses anyone without its key; the gateway has it only from the node's registration.
    assert httpx.post(endpoint + "/v1/chat/completions", json={"model": "sim-a", "messages": []}).status_code == 401
    cp.agent("n1")
    wait_until(lambda: not psutil.pid_exists(stranger) or psutil.Process(stranger).status() == psutil.STATUS_ZOMBIE,
               timeout_s=30, what="the unidentifiable engine stopped")
    server = next(p for p in cp.procs if p.name == "server")
    assert "cannot be adopted (model 'some-other-model' is not in the catalog)" in server.log()
    wait_until(lambda: any(r["id"] == "lost-record" and r["status"] == "ready" for r in cp.replicas()), timeout_s=15,
               what="adopted replica")
    wait_until(lambda: chat_ok(cp), what="traffic to the adopted engine (the key came back with the shard report)")
    time.sleep(3)  # a reconcile pass or two: min 1 is met by the adopted replica, nothing new is placed
    assert [r["id"] for r in cp.replicas() if r["model"] == "sim-a"] == ["lost-record"]
    assert psutil.pid_exists(ours)


def test_control_plane_restart_keeps_engines_and_the_agent_reports_them_again(control_plane):
    """Seeds 001, "Survive a control plane restart": the server and worker restart while the engine runs;
    the agent notices, registers again with every shard it runs, and nothing is restarted or duplicated."""
    cp = control_plane.start()
    agent = cp.agent("n1")
    assert cp.apply(CATALOG).status_code == 200
    [rep] = cp.wait_replicas("sim-a")
    pid = spec_pid(cp, "n1", rep["id"])
    for p in [p for p in cp.procs if p.name in ("server", "worker")]:
        p.stop()
    time.sleep(3)  # the agent's heartbeats fail meanwhile
    cp.start()
    wait_until(lambda: agent.log().count("registered node n1 (1 shard(s) running") >= 1, timeout_s=60,
               what="registration after the restart")
    wait_until(lambda: chat_ok(cp), timeout_s=30, what="traffic after the restart")
    time.sleep(3)
    reps = [r for r in cp.replicas() if r["model"] == "sim-a"]
    assert [(r["id"], r["status"]) for r in reps] == [(rep["id"], "ready")]
    assert spec_pid(cp, "n1", rep["id"]) == pid and psutil.pid_exists(pid)
