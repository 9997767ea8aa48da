"""A node refuses to fetch for or launch a shard of a replica it has been told to stop, across a restart of
its worker (node/fences.py). Node activities run as Temporal runs them (`ActivityEnvironment`) on a real
`Agent`; the whole path, through the control plane, is tests/faults/test_start_faults.py. Also the other
promises of the node's stop and wait activities under retry: a fence that cannot be written, a retried
wait for readiness."""

from __future__ import annotations

import time

import psutil
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from llmgw.node.activities import NodeActivities
from llmgw.config import Settings
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import FetchWeightsInput, LaunchShardInput, StopShardInput, WaitShardReadyInput
from llmgw.node.agent import Agent
from llmgw.node.fences import FENCE_ALL, Fences
from tests.helpers import sweep_engines


@pytest.fixture(autouse=True)
def no_engine_left(tmp_path):
    """Every engine a test here launched is killed when it ends, passed or failed (they run in sessions of
    their own, so nothing else would: one outlived a CI run)."""
    yield
    sweep_engines(tmp_path)


def agent(tmp_path) -> Agent:
    a = Agent(Settings(state_dir=tmp_path, node_id="n1", mirror_url="http://127.0.0.1:9"))
    reports = []

    async def report(r, attempts: int = 5):  # no control plane here: keep what would have been reported
        reports.append(r)
    a.report = report  # type: ignore[method-assign]
    a.reports = reports  # type: ignore[attr-defined]
    return a


def launch(replica: str, generation: int) -> LaunchShardInput:
    return LaunchShardInput(shard_id=f"{replica}-r0", replica_id=replica, model="m", profile=Profile(engine="sim"),
                            generation=generation)


async def test_a_stopped_replica_is_refused_even_after_the_worker_restarts(tmp_path):
    env = ActivityEnvironment()
    acts = NodeActivities(agent(tmp_path))
    # Told to stop replica rep1 (its start is still fetching somewhere): nothing runs yet, the fence is kept.
    res = await env.run(acts.stop_shard, StopShardInput(shard_id="rep1-r0", replica_id="rep1", generation=3))
    assert not res.was_running

    for a in (acts, NodeActivities(agent(tmp_path))):  # the same worker, then a restarted one
        with pytest.raises(ApplicationError) as exc:
            await env.run(a.launch_shard, launch("rep1", generation=2))
        assert exc.value.type == "Fenced" and "told to stop it (fence generation 3" in str(exc.value)
        with pytest.raises(ApplicationError) as exc:
            await env.run(a.fetch_weights, FetchWeightsInput(replica_id="rep1", source=None, generation=2))
        assert exc.value.type == "Fenced"
        assert a.agent.supervisor.get("rep1-r0") is None  # nothing was started

    # Another replica is not affected: it launches, and a stop from code that carried no generation (0)
    # fences every launch of it.
    other = await env.run(acts.launch_shard, launch("rep2", generation=1))
    assert other.pid > 0
    await env.run(acts.stop_shard, StopShardInput(shard_id="rep2-r0"))
    assert acts.agent.fences.get("rep2") == FENCE_ALL
    with pytest.raises(ApplicationError):
        await env.run(acts.launch_shard, launch("rep2", generation=1))


async def test_a_fence_that_cannot_be_written_does_not_keep_the_engine_running(tmp_path):
    """A full disk, or anything else that stops the fence file being written: the stop still stops the
    engine (the stop workflow settles the replica either way, and its GPUs count as free), then fails so
    that its retry records the fence."""
    env = ActivityEnvironment()
    acts = NodeActivities(agent(tmp_path))
    res = await env.run(acts.launch_shard, launch("rep3", generation=1))
    (acts.agent.fences.dir / "rep3").mkdir()  # the fence's file cannot be replaced: os.replace fails
    with pytest.raises(ApplicationError) as exc:
        await env.run(acts.stop_shard, StopShardInput(shard_id="rep3-r0", replica_id="rep3", generation=2))
    assert exc.value.type == "FenceNotRecorded" and "stopped shard rep3-r0, but could not record" in str(exc.value)
    assert not psutil.pid_exists(res.pid) or psutil.Process(res.pid).status() == psutil.STATUS_ZOMBIE
    (acts.agent.fences.dir / "rep3").rmdir()
    again = await env.run(acts.stop_shard, StopShardInput(shard_id="rep3-r0", replica_id="rep3", generation=2))
    assert not again.was_running and acts.agent.fences.get("rep3") == 2  # the retry records it


def test_fences_never_go_down_and_are_pruned_when_old(tmp_path):
    f = Fences(tmp_path / "fences")
    assert f.record("r", 5) == 5 and f.record("r", 2) == 5
    assert f.refuses("r", 4) == 5 and f.refuses("r", 5) is None  # a launch at the fence's generation is newer
    assert f.refuses("unknown", 0) is None
    assert f.record("../../etc/passwd", 1) == 1 and not (tmp_path / "etc").exists()  # names are never paths
    assert f.prune(keep_s=-1) == 2 and f.get("r") is None


async def test_start_shard_asks_before_fetching_and_after_a_long_fetch(tmp_path, monkeypatch):
    """`start_shard` (fetch, then launch, in one node activity) asks the control plane whether the replica
    is still wanted before it fetches, and again after a fetch longer than RECHECK_AFTER_S (here: any), and
    starts nothing unless it is; the fencing generation comes from the answer. A retry finds the shard
    running instead of starting a second one. The whole path, through the control plane:
    tests/faults/test_start_faults.py."""
    import llmgw.node.activities as node_activities
    from llmgw.schemas.api import LaunchCheckResponse
    from llmgw.schemas.payloads import NOT_WANTED, StartShardInput

    monkeypatch.setattr(node_activities, "RECHECK_AFTER_S", -1.0)
    env = ActivityEnvironment()
    acts = NodeActivities(agent(tmp_path))
    asked: list[str] = []
    answers = {"rep3": ["stopped"], "rep4": ["starting", "starting"], "rep5": ["starting", "evicted"]}

    async def launch_wanted(shard_id: str, replica_id: str, cache_name: str | None = None) -> LaunchCheckResponse:
        asked.append(shard_id)
        status = answers[replica_id].pop(0) if answers[replica_id] else "starting"
        return LaunchCheckResponse(wanted=status == "starting", status=status, generation=4)
    acts.agent.launch_wanted = launch_wanted  # type: ignore[method-assign]

    def start(replica: str) -> StartShardInput:
        return StartShardInput(launch=launch(replica, generation=0), source=None)

    with pytest.raises(ApplicationError) as exc:  # stopped before its fetch
        await env.run(acts.start_shard, start("rep3"))
    assert exc.value.type == NOT_WANTED and exc.value.non_retryable
    assert exc.value.details == ("stopped", "fetching weights")
    with pytest.raises(ApplicationError) as exc:  # evicted while it fetched
        await env.run(acts.start_shard, start("rep5"))
    assert exc.value.type == NOT_WANTED and exc.value.details == ("evicted", "launching")
    assert asked == ["rep3-r0", "rep5-r0", "rep5-r0"]
    assert acts.agent.supervisor.get("rep3-r0") is None and acts.agent.supervisor.get("rep5-r0") is None

    first = await env.run(acts.start_shard, start("rep4"))
    again = await env.run(acts.start_shard, start("rep4"))
    assert first.pid > 0 and again.adopted and again.pid == first.pid
    assert asked[3:] == ["rep4-r0", "rep4-r0"]  # before and after its fetch; the retry found it running
    # The commands carry the generation of the answer (4), not the input's (0): a fence at 4 lets them by.
    acts.agent.fences.record("rep6", 4)
    answers["rep6"] = []
    assert (await env.run(acts.start_shard, start("rep6"))).pid > 0
    await env.run(acts.stop_shard, StopShardInput(shard_id="rep6-r0", replica_id="rep6", generation=5))
    await env.run(acts.stop_shard, StopShardInput(shard_id="rep4-r0", replica_id="rep4", generation=5))
    with pytest.raises(ApplicationError) as exc:  # the fence still refuses a late retry
        await env.run(acts.start_shard, start("rep4"))
    assert exc.value.type == "Fenced"

    # The node API does not answer: nothing is fetched or launched, and the start is told to take its steps.
    import aiohttp

    from llmgw.schemas.payloads import UNREACHABLE

    async def unreachable(shard_id: str, replica_id: str, cache_name: str | None = None) -> LaunchCheckResponse:
        raise aiohttp.ClientConnectionError("connection refused")
    acts.agent.launch_wanted = unreachable  # type: ignore[method-assign]
    with pytest.raises(ApplicationError) as exc:
        await env.run(acts.start_shard, start("rep7"))
    assert exc.value.type == UNREACHABLE and exc.value.non_retryable and acts.agent.supervisor.get("rep7-r0") is None


async def test_a_retried_wait_for_readiness_resumes_from_its_heartbeat(tmp_path):
    """A retry of `wait_shard_ready` (its worker restarted, a heartbeat timed out) waits what is left of its
    timeout, not the whole of it again: readiness could otherwise take twice `replica_ready_timeout_s`."""
    import dataclasses

    a = agent(tmp_path)
    acts = NodeActivities(a)
    env = ActivityEnvironment()
    res = await env.run(acts.launch_shard, LaunchShardInput(
        shard_id="slow-r0", replica_id="slow", model="m", generation=1,
        profile=Profile(engine="sim", args=["--startup-delay", "30"])))
    try:
        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(retry.info, attempt=2, heartbeat_details=[{"waiting_s": 9}])
        t0 = time.monotonic()
        with pytest.raises(ApplicationError, match="not ready after 10s"):
            await retry.run(acts.wait_shard_ready, WaitShardReadyInput(shard_id="slow-r0", timeout_s=10))
        assert time.monotonic() - t0 < 4  # about the 1 s left, not 10
    finally:
        await acts.agent.supervisor.stop("slow-r0", 2)
    assert res.pid > 0
