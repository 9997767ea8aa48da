"""Faults while a replica starts (issue 9): the control worker dies between a commit and its completion, a
stop is decided while the replica fetches its weights, Temporal stops in the middle of a download. Real
server, worker, Postgres, Temporal, two simulated nodes, sim engines, a weights server whose downloads the
test holds, and traffic to a model that is already serving (it must not notice anything)."""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import psycopg
import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from tests.faults.conftest import FaultFleet, sim_model
from tests.faults.slow_source import SlowSource
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

STEADY = sim_model("steady", priority=10)


@pytest.fixture(scope="module")
def source():
    s = SlowSource()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def fleet(infra, tmp_path_factory):
    f = FaultFleet(tmp_path_factory.mktemp("start"), infra).start()
    try:
        assert f.cp.apply({"models": [STEADY]}).status_code == 200
        f.steady(["steady"])
        yield f
    finally:
        f.close()


def start_status(fleet: FaultFleet, replica_id: str) -> WorkflowExecutionStatus | None:
    """The status of the replica's start workflow in Temporal (None when Temporal does not answer)."""
    async def ask():
        client = await Client.connect(fleet.infra.temporal.address)
        return (await client.get_workflow_handle(f"replica/{replica_id}/start").describe()).status
    try:
        return asyncio.run(ask())
    except (RPCError, RuntimeError):
        return None


def start_parent(fleet: FaultFleet, replica_id: str) -> str | None:
    """The workflow id of the replica's start workflow's parent (None: started by a client, i.e. `decide`)."""
    async def ask():
        client = await Client.connect(fleet.infra.temporal.address)
        return (await client.get_workflow_handle(f"replica/{replica_id}/start").describe()).parent_id
    return asyncio.run(ask())


def closed(fleet: FaultFleet, replica_id: str) -> bool:
    return start_status(fleet, replica_id) not in (None, WorkflowExecutionStatus.RUNNING)


def only_replica(fleet: FaultFleet, model: str, status: str | None = None, timeout_s: float = 60) -> dict:
    def one():
        reps = fleet.replicas(model)
        return reps[0] if len(reps) == 1 and (status is None or reps[0]["status"] == status) else None
    return wait_until(one, timeout_s=timeout_s, what=f"one {status or ''} replica of {model}",
                      why=lambda: f"{fleet.replicas(model)}\n{fleet.cp.logs()}")


def crash_worker_after(fleet: FaultFleet, marker, hook: str, model: str) -> None:
    """Restart the control worker with the crash-after-commit hook `hook` (activity[:detail]), apply a
    catalog adding `model`, and wait until the hook has killed the worker."""
    hooked = fleet.restart_worker(LLMGW_TEST_CRASH_AFTER_COMMIT=hook, LLMGW_TEST_CRASH_MARKER=str(marker))
    assert fleet.cp.apply({"models": [STEADY, sim_model(model)]}).status_code == 200
    wait_until(lambda: marker.exists() and not hooked.alive(), timeout_s=90, what=f"the worker killed after {hook}",
               why=fleet.cp.logs)


def worker_log(fleet: FaultFleet) -> str:
    return "\n".join(p.log() for p in fleet.cp.procs if p.name == "worker")


def test_worker_killed_between_commit_and_completion_the_replica_ends_ready_once(fleet, tmp_path):
    """The control worker is SIGKILLed right after `mark_replica(ready)` committed, before Temporal heard
    it completed (a test hook, once). The restarted worker retries the activity, which returns the stored
    result: the replica stays Ready with the engine it has, nothing is stopped, nothing placed again."""
    with fleet.traffic(["steady"]) as t:
        crash_worker_after(fleet, tmp_path / "crashed-after-commit", "mark_replica:ready", "gamma")
        rep = only_replica(fleet, "gamma", "ready")  # committed before the kill
        pid = fleet.cp.shard_pid(rep["node_id"], f"{rep['id']}-r0")
        fleet.restart_worker()
        wait_until(lambda: start_status(fleet, rep["id"]) == WorkflowExecutionStatus.COMPLETED, timeout_s=90,
                   what="the start workflow completed after the retry", why=fleet.cp.logs)
        fleet.steady(["steady", "gamma"])
    assert "mark_replica retried after it committed" in worker_log(fleet)
    assert only_replica(fleet, "gamma", "ready")["id"] == rep["id"]
    assert fleet.cp.shard_pid(rep["node_id"], f"{rep['id']}-r0") == pid and psutil.pid_exists(pid)
    assert fleet.launches(rep["id"]) == 1
    assert t.count("steady") > 20 and t.failures("steady") == [], t.failures("steady")


def test_worker_killed_after_decide_committed_a_placement_the_replica_starts_once(fleet, tmp_path):
    """The control worker is SIGKILLed right after the reconciler's `decide` committed a pass that placed a
    replica (created in that pass's transaction, issue 13), before Temporal heard it completed. The retried
    `decide` returns the stored result and starts the start workflow of the replica it created (decide
    starts what it places, issue 13), once: one replica, one launch, Ready; the model already serving sees
    nothing."""
    with fleet.traffic(["steady"]) as t:
        crash_worker_after(fleet, tmp_path / "crashed-after-decide", "decide:place", "eta")
        placed = only_replica(fleet, "eta")  # committed before the kill
        fleet.restart_worker()
        ready = only_replica(fleet, "eta", "ready", timeout_s=90)
        wait_until(lambda: start_status(fleet, ready["id"]) == WorkflowExecutionStatus.COMPLETED, timeout_s=90,
                   what="the start workflow completed", why=fleet.cp.logs)
        fleet.steady(["steady", "eta"])
    assert "decide retried after it committed" in worker_log(fleet)
    assert ready["id"] == placed["id"] and len(fleet.replicas("eta")) == 1
    assert start_parent(fleet, ready["id"]) is None  # started by the retried decide, not by the reconciler
    assert fleet.launches(ready["id"]) == 1
    assert t.count("steady") > 20 and t.failures("steady") == [], t.failures("steady")


def test_a_placement_whose_pass_was_closed_before_its_start_gets_one_later(fleet, tmp_path):
    """As above, but the reconciler's run is terminated before the worker comes back (an operator, or the
    control worker replacing a run it found wedged), so no retry of that `decide` ever comes. The placement
    had sat `starting` with no start workflow, holding its GPU, until the start budget (an hour) failed it.
    A later pass finds it (control/starts.py) and starts it: the same replica becomes Ready, launched
    once, nothing placed again."""
    with fleet.traffic(["steady"]) as t:
        crash_worker_after(fleet, tmp_path / "crashed-after-decide", "decide:place", "iota")
        placed = only_replica(fleet, "iota")  # committed before the kill

        async def terminate():
            client = await Client.connect(fleet.infra.temporal.address)
            await client.get_workflow_handle("reconciler").terminate(reason="replaced (test)")
        asyncio.run(terminate())
        assert start_status(fleet, placed["id"]) is None  # no start workflow
        fleet.restart_worker()
        ready = only_replica(fleet, "iota", "ready", timeout_s=120)
        fleet.steady(["steady", "iota"])
    assert ready["id"] == placed["id"] and len(fleet.replicas("iota")) == 1
    assert "has no start workflow" in worker_log(fleet)
    assert fleet.launches(ready["id"]) == 1
    assert t.count("steady") > 20 and t.failures("steady") == [], t.failures("steady")


def test_readiness_is_pushed_by_the_node_a_frozen_control_worker_does_not_hold_a_ready_replica_back(fleet):
    """Issue 13: the node reports its engine ready to the control plane, which routes the replica at once.
    The control worker (where the start workflow would mark it Ready) is frozen with SIGSTOP once the engine
    is launched: the replica still becomes Ready and serves, while its start workflow is still running; once
    the worker is thawed the start completes with that replica, launched once."""
    theta = sim_model("theta", args=["--tokens-per-second", "0", "--startup-delay", "3"])
    assert fleet.cp.apply({"models": [STEADY, theta]}).status_code == 200
    rep = only_replica(fleet, "theta", "starting")
    wait_until(lambda: fleet.launches(rep["id"]) == 1, timeout_s=60, what="theta's engine launched", why=fleet.cp.logs)
    worker = fleet.freeze("worker")
    try:
        ready = only_replica(fleet, "theta", "ready", timeout_s=30)
        r = httpx.post(fleet.cp.gateway + "/v1/chat/completions", timeout=30, json={
            "model": "theta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert start_status(fleet, rep["id"]) == WorkflowExecutionStatus.RUNNING  # it had no worker to get there
    finally:
        fleet.thaw(worker)
    wait_until(lambda: start_status(fleet, rep["id"]) == WorkflowExecutionStatus.COMPLETED, timeout_s=60,
               what="the start workflow completed", why=fleet.cp.logs)
    assert ready["id"] == rep["id"] and only_replica(fleet, "theta", "ready")["id"] == rep["id"]
    assert fleet.launches(rep["id"]) == 1


def test_stop_decided_while_fetching_no_engine_ever_starts(fleet, source):
    """A replica is stopped (its model leaves the catalog) while it fetches its weights. The stop marks it,
    cancels its start and waits for it; no engine is ever launched for it, not even once the download could
    have finished; its node holds the fence."""
    source.hold()
    delta = sim_model("delta", source=source.url("delta.bin"))
    assert fleet.cp.apply({"models": [STEADY, delta]}).status_code == 200
    rep = only_replica(fleet, "delta", "starting")
    assert source.served_head.wait(60), "the download never started"
    assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
    wait_until(lambda: fleet.replicas("delta")[0]["status"] == "stopped", timeout_s=60, what="delta stopped",
               why=fleet.cp.logs)
    source.release()  # a fetch still going would complete now, and a launch would follow
    wait_until(lambda: closed(fleet, rep["id"]), timeout_s=60, what="delta's start closed", why=fleet.cp.logs)
    time.sleep(3)
    assert fleet.launches(rep["id"]) == 0
    # Cancelled by the stop while it fetched (not failed by a refused launch: the node's fence is the
    # second line of defence, tests/test_fences.py).
    assert start_status(fleet, rep["id"]) == WorkflowExecutionStatus.CANCELED
    node = rep["shards"][0]["node_id"]
    assert not (fleet.cp.state / "shards" / node / f"{rep['id']}-r0.json").exists()
    assert (fleet.cp.state / "shards" / node / "fences" / rep["id"]).exists()
    fleet.steady(["steady"])


def test_a_start_whose_cancellation_never_came_is_not_launched_the_node_asks_after_its_fetch(fleet, source):
    """The replica is marked stopped while its node fetches (the first step of a stop), and the stop's
    cancellation never reaches the start: the control worker is frozen with SIGSTOP, so no workflow moves.
    When the download completes, the node asks the control plane over the node API whether the replica is
    still wanted before it launches (`start_shard`), hears "stopped", and launches nothing. Once thawed, the
    start ends (failed with that reason) and the replica is cleaned up, never launched."""
    source.hold()
    kappa = sim_model("kappa", source=source.url("kappa.bin"))
    assert fleet.cp.apply({"models": [STEADY, kappa]}).status_code == 200
    rep = only_replica(fleet, "kappa", "starting")
    assert source.served_head.wait(60), "the download never started"
    worker = fleet.freeze("worker")
    try:
        with psycopg.connect(fleet.infra.pg.url) as conn:
            conn.execute("UPDATE replicas SET status = 'stopped', generation = generation + 1 WHERE id = %s",
                         (rep["id"],))
        source.release()
        refusal = f"did not start shard {rep['id']}-r0: its replica became stopped before launching"
        wait_until(lambda: refusal in "\n".join(p.log() for p in fleet.cp.procs if p.name.startswith("agent")),
                   timeout_s=60, what="the node's refusal after its fetch", why=fleet.cp.logs)
        assert fleet.launches(rep["id"]) == 0
    finally:
        fleet.thaw(worker)
    wait_until(lambda: closed(fleet, rep["id"]), timeout_s=60, what="kappa's start closed", why=fleet.cp.logs)
    # Failed by the node's answer (or cancelled by the cleanup that follows, if it came first).
    assert start_status(fleet, rep["id"]) in (WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.CANCELED)
    assert fleet.launches(rep["id"]) == 0
    assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
    fleet.steady(["steady"])


def test_node_api_down_when_a_start_asks_the_start_takes_its_steps_and_launches_once(fleet, source):
    """`llmgw server` (the gateway and its node-API child) is stopped while a replica downloads its weights,
    so when the download completes its node cannot ask the control plane "still wanted?" over the node API.
    The start does not fail for it: it takes its steps instead (asked through the control worker, then
    fetch, then launch, as before issue 13), the replica becomes Ready with one launch, and serves once the
    server is back. The replica already serving is never touched."""
    source.hold()
    before = fleet.serving()["steady"]
    mu = sim_model("mu", source=source.url("mu.bin"))
    assert fleet.cp.apply({"models": [STEADY, mu]}).status_code == 200
    rep = only_replica(fleet, "mu", "starting")
    assert source.served_head.wait(60), "the download never started"
    server = fleet.proc("server")
    server.stop()
    try:
        source.release()
        agents = lambda: "\n".join(p.log() for p in fleet.cp.procs if p.name.startswith("agent"))  # noqa: E731
        wait_until(lambda: f"could not ask the control plane whether shard {rep['id']}-r0 may start" in agents(),
                   timeout_s=60, what="the node failing to ask", why=fleet.cp.logs)
        wait_until(lambda: fleet.launches(rep["id"]) == 1, timeout_s=60, what="mu launched by the steps",
                   why=fleet.cp.logs)
    finally:
        fleet.cp.spawn("server", "server")
    wait_until(lambda: start_status(fleet, rep["id"]) == WorkflowExecutionStatus.COMPLETED, timeout_s=120,
               what="mu's start completed", why=fleet.cp.logs)
    serving = fleet.steady(["steady", "mu"], timeout_s=120)
    assert serving["mu"][0] == rep["id"] and fleet.launches(rep["id"]) == 1
    assert serving["steady"] == before  # the same replica, node and engine pid
    assert [r["status"] for r in fleet.replicas("mu")] == ["ready"]  # never failed, never placed again


def test_temporal_stopped_mid_download_resumes_and_launches_once(fleet, source):
    """Temporal is stopped while a replica downloads its weights, then started again. Serving never needed
    it (zero failed requests); the download carries on where it was, and the replica is launched once."""
    source.hold()
    eps_url = source.url("epsilon.bin")
    with fleet.traffic(["steady"]) as t:
        assert fleet.cp.apply({"models": [STEADY, sim_model("epsilon", source=eps_url)]}).status_code == 200
        rep = only_replica(fleet, "epsilon", "starting")
        assert source.served_head.wait(60), "the download never started"
        fleet.infra.stop_temporal()
        try:
            time.sleep(8)
        finally:
            fleet.infra.start_temporal()
        source.release()
        fleet.steady(["steady", "epsilon"], timeout_s=120)
    assert only_replica(fleet, "epsilon", "ready")["id"] == rep["id"]
    assert fleet.launches(rep["id"]) == 1
    asked = [rng for path, rng in source.requests if path == "/epsilon.bin"]
    assert asked[0] is None and all(r is not None for r in asked[1:]), asked  # never started over
    assert t.count("steady") > 20 and t.failures("steady") == [], t.failures("steady")


def test_a_start_past_its_budget_is_failed_by_the_planner(fleet, source):
    """A start that cannot finish (its download is held) outlives its profile's `start_timeout`: the planner
    fails the replica, which cancels the start workflow, stops what it had and frees its GPUs; the failure
    counts against the model's backoff. Nothing was ever launched."""
    source.hold()
    zeta = sim_model("zeta", source=source.url("zeta.bin"), start_timeout="4s")
    try:
        assert fleet.cp.apply({"models": [STEADY, zeta]}).status_code == 200
        rep = only_replica(fleet, "zeta", "starting")
        wait_until(lambda: next(r for r in fleet.replicas("zeta") if r["id"] == rep["id"])["status"] == "failed",
                   timeout_s=60, what="zeta failed by the planner", why=fleet.cp.logs)
        failed = next(r for r in fleet.replicas("zeta") if r["id"] == rep["id"])
        assert "longer than its start budget of 4s" in failed["failure"], failed
        wait_until(lambda: closed(fleet, rep["id"]), timeout_s=60, what="zeta's start closed", why=fleet.cp.logs)
        assert start_status(fleet, rep["id"]) == WorkflowExecutionStatus.CANCELED
        assert fleet.launches(rep["id"]) == 0
        with psycopg.connect(fleet.infra.pg.url) as conn:
            [(failures,)] = conn.execute("SELECT failures FROM model_state WHERE name = 'zeta'").fetchall()
        assert failures >= 1
    finally:
        assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
        source.release()
    fleet.steady(["steady"])


def test_an_agent_restarted_while_temporal_is_down_registers_at_once_and_keeps_its_engines(fleet):
    """Temporal is stopped and a node's agent crashes (SIGKILL: its engines run on) and is started again.
    It registers at once over the node API, adopts its engine and heartbeats, though it cannot reach
    Temporal: before, it waited a minute for Temporal before registering at all, then exited, and a
    registration's answer waited on a wake-up signal to the reconciler that Temporal could not take. When
    Temporal is back, the same engine serves: no failed request, no replica rebuilt, the same pid."""
    before = fleet.steady(["steady"])
    _, node, _ = before["steady"]
    relays = fleet.relays[node]
    with fleet.traffic(["steady"]) as t:
        fleet.infra.stop_temporal()
        try:
            fleet.proc(f"agent-{node}").kill()
            again = fleet.cp.agent(node, simulate=sim_spec(gpus=2),
                                   LLMGW_NODE_API_URL=f"https://127.0.0.1:{relays['api'].port}",
                                   LLMGW_TEMPORAL_ADDRESS=f"127.0.0.1:{relays['temporal'].port}")
            wait_until(lambda: f"registered node {node} (1 shard(s) running" in again.log(), timeout_s=8,
                       what="the restarted agent registered with Temporal away", why=again.log)
            time.sleep(3)  # heartbeating, with Temporal still away
            assert again.alive(), again.log()
        finally:
            fleet.infra.start_temporal()
        after = fleet.steady(["steady"], timeout_s=120)
    assert after["steady"] == before["steady"]  # the same replica, node and engine pid
    assert t.count("steady") > 10 and t.failures("steady") == [], t.failures("steady")


def test_an_agent_killed_mid_download_resumes_on_its_next_boot_and_nothing_is_rebuilt(fleet, source):
    """A node's agent is SIGKILLed while a replica downloads its weights, and started again. Before, its
    registration marked the replica lost (its shard was not reported), a new replica was placed, and the
    dead attempt stayed open until its heartbeat timeout (60 s). Now the shard, which no boot had reported
    launching, is kept; the new boot ends the attempt its predecessor left (node/attempts.py) and
    Temporal retries it at once: the same replica resumes the download where it was and is launched once,
    well inside that minute, never lost; the replica already serving is not touched."""
    source.hold()
    before = fleet.serving()["steady"]
    nu = sim_model("nu", source=source.url("nu.bin"))
    assert fleet.cp.apply({"models": [STEADY, nu]}).status_code == 200
    rep = only_replica(fleet, "nu", "starting")
    assert source.served_head.wait(60), "the download never started"
    node = rep["shards"][0]["node_id"]

    def downloaded() -> int:  # the partial file in the node's cache (as a separate machine has its own)
        parts = [f for f in (fleet.cp.state / "cache" / node).rglob("*") if f.is_file() and "part" in f.name]
        return max([f.stat().st_size for f in parts] or [0])
    wait_until(lambda: downloaded() >= source.head, timeout_s=30, what="the first MiB on the node's disk")
    relays = fleet.relays[node]
    fleet.proc(f"agent-{node}").kill()
    again = fleet.cp.agent(node, simulate=sim_spec(gpus=2), LLMGW_NODE_API_URL=f"https://127.0.0.1:{relays['api'].port}",
                           LLMGW_TEMPORAL_ADDRESS=f"127.0.0.1:{relays['temporal'].port}")
    restarted = time.monotonic()
    try:
        ended = f"ended the start_shard of replica/{rep['id']}/start attempt a previous boot left running"
        wait_until(lambda: ended in again.log(), timeout_s=30,
                   what="the new boot ending the attempt its predecessor left", why=again.log)
    finally:
        source.release()
    ready = only_replica(fleet, "nu", "ready", timeout_s=60)
    assert time.monotonic() - restarted < 40, "waited for the dead attempt's heartbeat timeout"
    assert ready["id"] == rep["id"] and fleet.launches(rep["id"]) == 1
    assert [r["status"] for r in fleet.replicas("nu")] == ["ready"]  # never lost, never placed again
    asked = [rng for path, rng in source.requests if path == "/nu.bin"]
    assert asked[0] is None and asked[-1] == f"bytes={source.head}-", asked  # resumed, not started over
    assert fleet.steady(["steady", "nu"])["steady"] == before
    assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
    fleet.steady(["steady"])


def test_an_agent_killed_between_spawning_an_engine_and_recording_it_adopts_that_engine(fleet, tmp_path):
    """Issue 38: a node's agent is SIGKILLed right after it spawned an engine, before it recorded the engine's
    pid (a test hook, once). Before, the next boot could not see that engine: it ran on unseen, holding its
    port and GPU, while the retried start launched a second one. Now the spec file is written before the
    spawn and the engine carries its shard id, so the next boot adopts it: the replica becomes Ready on that
    very engine, no second engine is launched, and the replica already serving is not touched."""
    before = fleet.steady(["steady"])["steady"]
    marker = tmp_path / "spawned"
    for node in ("node-a", "node-b"):  # wherever the new replica lands, its agent has the hook
        fleet.restart_agent(node, LLMGW_TEST_CRASH_AFTER_SPAWN=str(marker))
    fleet.cp.wait_nodes("node-a", "node-b", timeout_s=60)
    assert fleet.cp.apply({"models": [STEADY, sim_model("xi")]}).status_code == 200
    wait_until(marker.exists, timeout_s=90, what="the agent killed after a spawn", why=fleet.cp.logs)
    shard_id, pid = marker.read_text().split()
    node = next(n for n in ("node-a", "node-b") if (fleet.cp.state / "shards" / n / f"{shard_id}.json").exists())
    wait_until(lambda: not any(p.alive() for p in fleet.cp.procs if p.name == f"agent-{node}"), timeout_s=10,
               what="the hooked agent gone")
    assert psutil.pid_exists(int(pid))  # the engine runs on, unrecorded
    again = fleet.restart_agent(node)
    wait_until(lambda: "launched by a worker that died before recording it" in again.log(), timeout_s=30,
               what="the new boot adopting the engine", why=again.log)
    ready = only_replica(fleet, "xi", "ready", timeout_s=60)
    assert f"{ready['id']}-r0" == shard_id
    assert fleet.serving()["xi"] == (ready["id"], node, int(pid))  # served by the engine spawned before the crash
    assert fleet.launches(ready["id"]) == 0  # (the hook killed it before its log line) the retry adopted, never launched
    engines = [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("LLMGW_SHARD_ID") == shard_id]
    assert [p.pid for p in engines] == [int(pid)]
    assert fleet.steady(["steady", "xi"])["steady"] == before
    assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
    fleet.steady(["steady"])


def test_an_agent_restarted_more_than_five_times_during_one_download_does_not_fail_the_start(fleet, source):
    """Issue 38: each boot of a node's worker ends the attempt its predecessor left, and Temporal counts it;
    `start_shard` had 5 attempts, so five agent restarts during one long download failed the start. Now a
    start's fetch is bounded by time (no progress for `fetch_retry_s`; the planner's start budget), not by
    attempts: six restarts during one held download, and the replica still starts, once, resuming its
    download each time; the replica already serving is not touched."""
    source.hold()
    before = fleet.serving()["steady"]
    rho = sim_model("rho", source=source.url("rho.bin"))
    assert fleet.cp.apply({"models": [STEADY, rho]}).status_code == 200
    rep = only_replica(fleet, "rho", "starting")
    assert source.served_head.wait(60), "the download never started"
    node = rep["shards"][0]["node_id"]
    ended = f"ended the start_shard of replica/{rep['id']}/start attempt a previous boot left running"

    def on_disk() -> bool:  # the first MiB in the node's cache: each attempt after it resumes from there
        parts = [f for f in (fleet.cp.state / "cache" / node).rglob("*") if f.is_file() and "part" in f.name]
        return max([f.stat().st_size for f in parts] or [0]) >= source.head
    wait_until(on_disk, timeout_s=30, what="the first MiB on the node's disk")
    try:
        for i in range(6):
            asked = sum(1 for path, _ in source.requests if path == "/rho.bin")
            again = fleet.restart_agent(node)
            wait_until(lambda: ended in again.log(), timeout_s=30, what=f"restart {i + 1} ending the attempt",
                       why=again.log)
            wait_until(lambda: sum(1 for path, _ in source.requests if path == "/rho.bin") > asked, timeout_s=45,
                       what=f"the download resumed after restart {i + 1}", why=fleet.cp.logs)
    finally:
        source.release()
    ready = only_replica(fleet, "rho", "ready", timeout_s=60)
    assert ready["id"] == rep["id"] and fleet.launches(rep["id"]) == 1
    assert [r["status"] for r in fleet.replicas("rho")] == ["ready"]
    asked = [rng for path, rng in source.requests if path == "/rho.bin"]
    assert len(asked) >= 7 and all(rng == f"bytes={source.head}-" for rng in asked[1:]), asked  # resumed each time
    assert fleet.steady(["steady", "rho"])["steady"] == before
    assert fleet.cp.apply({"models": [STEADY]}).status_code == 200
    fleet.steady(["steady"])
