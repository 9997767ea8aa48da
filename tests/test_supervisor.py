"""Engine supervision with real processes (the sim engine): process groups, exit reports with the
output tail, escalation to SIGKILL, and adoption by a new supervisor from the spec files."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import aiohttp
import psutil

from llmgw.dev.procs import free_port
from llmgw.engines.base import LaunchPlan, ShardSpec
from llmgw.engines.sim import SimAdapter
from llmgw.schemas.catalog import Profile
from llmgw.node.supervisor import Supervisor


def sim_spec(shard_id: str = "rep1-r0") -> ShardSpec:
    return ShardSpec(shard_id=shard_id, replica_id="rep1", model="m", port=free_port(),
                     profile=Profile(engine="sim", args=["--tokens-per-second", "0"]))


async def wait_ready(endpoint: str, timeout_s: float = 15) -> None:
    adapter = SimAdapter()
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + timeout_s
        while not await adapter.is_ready(s, endpoint):
            assert time.monotonic() < deadline, "sim engine never became ready"
            await asyncio.sleep(0.1)


async def test_exit_is_reported_with_output_tail(tmp_path):
    exits = []

    async def on_exit(shard, tail):
        exits.append((shard.shard_id, shard.exit_code, tail))

    sup = Supervisor(tmp_path / "shards", tmp_path / "logs", on_exit=on_exit)
    spec = sim_spec()
    plan = LaunchPlan(argv=[sys.executable, "-c", "import sys; print('boom: out of memory'); sys.exit(3)"],
                      env=dict(os.environ), endpoint="http://127.0.0.1:1")
    sup.launch(spec, plan)
    watcher = asyncio.create_task(sup.watch(0.05))
    try:
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
    assert exits and exits[0][0] == "rep1-r0" and exits[0][1] == 3
    assert "boom: out of memory" in exits[0][2]
    assert not (tmp_path / "shards" / "rep1-r0.json").exists()


async def test_stop_signals_the_whole_group_and_escalates(tmp_path):
    sup = Supervisor(tmp_path / "shards", tmp_path / "logs")
    # A parent that ignores SIGTERM and a child in the same group: both must be gone after stop.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            "time.sleep(60)")
    shard = sup.launch(sim_spec(), LaunchPlan(argv=[sys.executable, "-c", code], env=dict(os.environ), endpoint="x"))
    await asyncio.sleep(0.5)
    members = [p for p in psutil.process_iter() if _pgid(p) == shard.pid]
    assert len(members) == 2
    t = time.monotonic()
    was, _ = await sup.stop(shard.shard_id, grace_s=0.5)
    assert was and time.monotonic() - t < 5
    await asyncio.sleep(0.2)
    assert not [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


async def test_new_supervisor_adopts_running_engine_and_can_stop_it(tmp_path):
    first = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    shard = first.launch(spec, SimAdapter().build(spec))
    await wait_ready(shard.endpoint)

    second = Supervisor(tmp_path / "shards", tmp_path / "logs")  # a restarted worker
    adopted, dead = second.adopt_all()
    assert [s.shard_id for s in adopted] == ["rep1-r0"] and dead == []
    assert adopted[0].pid == shard.pid and adopted[0].proc is None
    assert second.poll(adopted[0]) is None  # watched by polling, still running
    async with aiohttp.ClientSession() as s:  # and still serving
        async with s.post(shard.endpoint + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
    was, _ = await second.stop("rep1-r0", grace_s=5)
    assert was
    first.poll(shard)  # reap our child
    assert not psutil.pid_exists(shard.pid) or psutil.Process(shard.pid).status() == psutil.STATUS_ZOMBIE


async def test_dead_engine_is_not_adopted(tmp_path):
    first = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    shard = first.launch(spec, SimAdapter().build(spec))
    shard.proc.kill()
    shard.proc.wait()
    adopted, dead = Supervisor(tmp_path / "shards", tmp_path / "logs").adopt_all()
    assert adopted == [] and dead == ["rep1-r0"]


async def test_an_engine_is_still_recognised_after_the_system_clock_was_stepped(tmp_path, monkeypatch):
    """psutil's create_time is wall-clock seconds from the boot time as read now: after a clock step (NTP,
    a VM resumed) and a worker restart it no longer matches the spec file, and a healthy engine was taken
    for dead, reported failed and left running unsupervised. Its start in ticks since boot does not move."""
    first = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    shard = first.launch(spec, SimAdapter().build(spec))
    try:
        assert shard.start_ticks is not None
        await wait_ready(shard.endpoint)
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 30.0)  # the clock stepped 30 s
        second = Supervisor(tmp_path / "shards", tmp_path / "logs")
        adopted, dead = second.adopt_all()
        assert [s.shard_id for s in adopted] == ["rep1-r0"] and dead == [], dead
        assert second.poll(adopted[0]) is None
    finally:
        shard.proc.kill()
        shard.proc.wait()


async def test_a_pid_reused_by_another_process_is_not_adopted(tmp_path):
    # A spec file naming a pid that now belongs to another process: its create time may even agree to
    # 50 ms, its start ticks do not.
    sup = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    shard = sup.launch(spec, SimAdapter().build(spec))
    try:
        me = psutil.Process(os.getpid())
        d = shard.to_json() | {"pid": me.pid, "create_time": me.create_time(), "start_ticks": shard.start_ticks}
        (tmp_path / "shards" / "rep1-r0.json").write_text(json.dumps(d))
        adopted, dead = Supervisor(tmp_path / "shards", tmp_path / "logs").adopt_all()
        assert adopted == [] and dead == ["rep1-r0"]
    finally:
        shard.proc.kill()
        shard.proc.wait()


CHILD_STAYS = ("import os, signal, subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
               "signal.SIG_IGN); time.sleep(600)'])\n"
               "open(sys.argv[1], 'w').write(str(child.pid))\n"
               "{leader}")


async def _with_a_child(tmp_path, leader: str):
    sup = Supervisor(tmp_path / "shards", tmp_path / "logs")
    child_file = tmp_path / "child.pid"
    plan = LaunchPlan(argv=[sys.executable, "-c", CHILD_STAYS.format(leader=leader), str(child_file)],
                      env=dict(os.environ), endpoint="http://127.0.0.1:1")
    sup.launch(sim_spec(), plan)
    for _ in range(100):
        if child_file.exists() and child_file.read_text():
            break
        await asyncio.sleep(0.05)
    return sup, int(child_file.read_text())


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_stopped_engine_s_children_are_stopped_with_it(tmp_path):
    """The leader exits on SIGTERM; a child it started ignores SIGTERM (vLLM's EngineCore hung in CUDA).
    Before, the leader's exit ended the stop and the spec file was removed: the child kept its GPUs, and
    nothing would ever find it again. Now the stop goes on until the group is empty (SIGKILL after the grace)."""
    sup, child = await _with_a_child(tmp_path, "time.sleep(600)")
    try:
        running, _ = await sup.stop("rep1-r0", grace_s=1.0)
        assert running and _gone(child), psutil.Process(child).status()
    finally:
        if not _gone(child):
            os.kill(child, 9)


async def test_an_engine_whose_leader_dies_does_not_leave_its_children_running(tmp_path):
    """The leader crashes (exit 1) while its child lives on (a `ray_launch` leader dying while Ray's
    processes live): the exit is reported and the rest of its group is stopped, not forgotten."""
    sup, child = await _with_a_child(tmp_path, "time.sleep(0.5); sys.exit(1)")
    watcher = asyncio.create_task(sup.watch(0.05))
    try:
        for _ in range(200):
            if _gone(child):
                break
            await asyncio.sleep(0.05)
        assert _gone(child) and not sup.shards
    finally:
        watcher.cancel()
        if not _gone(child):
            os.kill(child, 9)


async def test_an_engine_whose_spec_file_another_version_wrote_is_adopted_not_abandoned(tmp_path):
    """A restarted agent of another version (a profile field added, or one it no longer knows) could not
    parse a spec file, deleted it and went on: the engine ran on, unsupervised and never stopped, holding
    its GPUs. Now it is adopted from what the file still says, and can be stopped; a file that names no
    process it can read is kept aside (`.bad`), never deleted."""
    first = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    shard = first.launch(spec, SimAdapter().build(spec))
    await wait_ready(shard.endpoint)
    path = tmp_path / "shards" / "rep1-r0.json"
    d = json.loads(path.read_text())
    d["profile"]["speculative_decoding"] = {"draft": "x"}  # a field from a newer llmgw
    path.write_text(json.dumps(d))
    (tmp_path / "shards" / "garbled-r0.json").write_text("{not json")

    second = Supervisor(tmp_path / "shards", tmp_path / "logs")
    adopted, dead = second.adopt_all()
    assert [s.shard_id for s in adopted] == ["rep1-r0"] and adopted[0].spec.profile.engine == "sim"
    assert dead == ["garbled-r0"] and (tmp_path / "shards" / "garbled-r0.json.bad").exists()
    was, _ = await second.stop("rep1-r0", grace_s=5)
    assert was
    first.poll(shard)
    assert not psutil.pid_exists(shard.pid) or psutil.Process(shard.pid).status() == psutil.STATUS_ZOMBIE


async def test_an_engine_that_floods_its_log_is_held_to_the_cap_and_keeps_writing(tmp_path):
    """An engine in an error loop (or logging every request) appended to its log without bound and filled
    the disk. Past the cap its last MiB is kept aside and the log starts again; the engine, writing with
    O_APPEND, carries on at the new end."""
    sup = Supervisor(tmp_path / "shards", tmp_path / "logs", log_max_bytes=1 << 20)
    flood = "import sys, time\nwhile True:\n    sys.stdout.write('x' * 4095 + '\\n'); sys.stdout.flush(); time.sleep(0.0005)\n"
    plan = LaunchPlan(argv=[sys.executable, "-c", flood], env=dict(os.environ), endpoint="http://127.0.0.1:1")
    shard = sup.launch(sim_spec(), plan)
    try:
        for _ in range(100):
            if shard.log_path.stat().st_size > 2 << 20:
                break
            await asyncio.sleep(0.05)
        sup.cap_logs()
        kept = shard.log_path.with_name(shard.log_path.name + ".1")
        assert kept.stat().st_size == 1 << 20 and shard.log_path.stat().st_size < 1 << 20
        await asyncio.sleep(0.3)
        assert shard.log_path.stat().st_size > 0  # still writing, at the new end
        assert oct(kept.stat().st_mode & 0o777) == "0o600"
    finally:
        await sup.stop("rep1-r0", grace_s=1)


async def test_an_engine_spawned_before_its_worker_recorded_it_is_adopted_by_the_next(tmp_path):
    """Issue 38: the spec file is written before the spawn (pid 0), and the engine carries its shard id in its
    environment; a worker that died between the spawn and recording the pid leaves that first spec, and the
    next boot finds the engine by its marker and adopts it. A launching spec whose engine never ran is gone."""
    sup = Supervisor(tmp_path / "shards", tmp_path / "logs")
    spec = sim_spec()
    plan = LaunchPlan(argv=[sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ),
                      endpoint="http://127.0.0.1:1")
    shard = sup.launch(spec, plan)
    for _ in range(100):  # (read at once, /proc/PID/environ may still be empty: the exec is under way)
        if psutil.Process(shard.pid).environ():
            break
        await asyncio.sleep(0.02)
    assert psutil.Process(shard.pid).environ().get("LLMGW_SHARD_ID") == "rep1-r0"
    # What the worker had written when it died: the spec from before the spawn.
    path = tmp_path / "shards" / "rep1-r0.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": 0, "create_time": 0.0, "start_ticks": None}))
    never = json.loads(path.read_text()) | {"shard_id": "rep2-r0", "replica_id": "rep2"}
    (tmp_path / "shards" / "rep2-r0.json").write_text(json.dumps(never))
    try:
        again = Supervisor(tmp_path / "shards", tmp_path / "logs")
        adopted, dead = again.adopt_all()
        assert [(s.shard_id, s.pid) for s in adopted] == [("rep1-r0", shard.pid)] and dead == ["rep2-r0"]
        assert json.loads(path.read_text())["pid"] == shard.pid  # recorded now
        assert not (tmp_path / "shards" / "rep2-r0.json").exists()
        stopped, _ = await again.stop("rep1-r0", grace_s=2)
        assert stopped and not psutil.pid_exists(shard.pid) or psutil.Process(shard.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if shard.proc is not None and shard.proc.poll() is None:
            shard.proc.kill()
