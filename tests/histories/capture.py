"""Capture workflow histories from real runs, for the replay tests (`tests/test_replay.py`).

Not part of the suite (the file name does not match `test_*.py`). Run it explicitly against the code whose
histories you want to keep, before changing workflow code:

    LLMGW_HISTORIES_OUT=tests/histories/v2 .venv/bin/python -m pytest tests/histories/capture.py

Folders: `v1` was captured from code that planned inside the reconciler workflow; `v2` from code with the
`decide` activity and several placements per pass; `v3` from code whose `decide` creates the replicas it
places and whose starts check "still wanted?" as local activities (issue 13); `v4` from code whose `decide`
also starts the start workflows it places and whose single-shard starts fetch and launch in one node
activity, `start_shard` (issue 13); `v5` from code whose settle of a failed replica counts its failure in
the same activity (patch `settle-counts-failure`); `v6` holds one history from the workflow-level test
`tests/test_start_workflow.py::test_a_start_that_finds_its_replica_draining_leaves_the_engine_to_the_drain`
(stand-in activities; patch `drain-owns-the-engine`), a path no scenario here reaches on purpose.
`v7` holds the two runs (one continue-as-new) of a `BatchWorkflow` from
`tests/test_batches_units.py::test_the_workflow_runs_rounds_then_finishes_with_their_reason` (stand-in
activities; `LLMGW_HISTORIES_OUT=tests/histories/v7` when running it writes them). `v8` holds the sleep
and wake workflows of issue 39 (`test_sleep_and_wake` here), captured before the wake's control steps
became local activities (patch `wake-local-steps`). `v9` holds pre-staging's `StageWeightsWorkflow`
(`test_prestage` here; issue 39), and the start of the replica that then found the weights staged.

Each scenario runs the real control plane, Temporal, Postgres and simulated agents, then writes every
workflow history it produced as `<scenario>--<workflow id with / as _>.json` (Temporal's JSON history
format, `WorkflowHistory.to_json()`). Commit the files: from then on a change to workflow code that
cannot replay them fails CI, and must be versioned (`workflow.patched`) instead.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.fleet import sim_spec
from tests.helpers import wait_until

OUT = os.environ.get("LLMGW_HISTORIES_OUT")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not OUT, reason="set LLMGW_HISTORIES_OUT to the folder to write histories to")]


async def _export(address: str, namespace: str, scenario: str, kinds: tuple[str, ...] = ()) -> list[Path]:
    client = await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)
    out = Path(OUT or ".")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    async for wf in client.list_workflows():
        if kinds and wf.workflow_type not in kinds:
            continue
        h = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        name = f"{scenario}--{re.sub(r'[^A-Za-z0-9._-]', '_', wf.id)}--{wf.run_id[-8:]}.json"
        (out / name).write_text(h.to_json())
        written.append(out / name)
    return written


def export(temporal, namespace: str, scenario: str, kinds: tuple[str, ...] = ()) -> list[Path]:
    """Write every workflow history of the namespace (or only those of the workflow types `kinds`)."""
    return asyncio.run(_export(temporal.address, namespace, scenario, kinds))


def chat(cp, model: str) -> int:
    return httpx.post(cp.gateway + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code


def test_place_two_shards_fail_and_drain(control_plane, temporal, namespace):
    """Reconciler passes that place, stop and clean up; a two-shard (TP8 over two nodes) start; a failed
    start (a shard dies before it is ready); a drain and stop when the model leaves the catalog."""
    cp = control_plane.start()
    for n in ("gpu-a", "gpu-b"):
        cp.agent(n, simulate=sim_spec(gpus=4, fabric="ib-a"))
    cp.agent("cpu-c", simulate=sim_spec(gpus=0))
    cp.wait_nodes("gpu-a", "gpu-b", "cpu-c")
    big = {"name": "big", "scaling": {"min": 1, "max": 1},
           "profiles": [{"engine": "sim", "tp": 8, "nodes": 2, "gpu_memory_gb": 40, "args": ["--tokens-per-second", "0"]}]}
    assert cp.apply({"models": [big]}).status_code == 200
    cp.wait_replicas("big", timeout_s=90)
    wait_until(lambda: chat(cp, "big") == 200, timeout_s=20, what="big serving")
    # A start that fails: the sim engine refuses an argument it does not know and exits.
    broken = {"name": "broken", "scaling": {"min": 1, "max": 1},
              "profiles": [{"engine": "sim", "args": ["--startup-delay", "not-a-number"]}]}
    assert cp.apply({"models": [big, broken]}).status_code == 200
    cp.wait_replicas("broken", "failed", timeout_s=60)
    # The model leaves the catalog: drained, then stopped.
    assert cp.apply({"models": [broken]}).status_code == 200
    cp.wait_replicas("big", "stopped", timeout_s=60)
    wait_until(lambda: all(r["status"] in ("stopped", "failed") for r in cp.replicas()), timeout_s=30,
               what="every replica ended")
    assert len(export(temporal, namespace, "place-fail-drain")) >= 4


def test_evict_for_a_higher_priority_model(control_plane, temporal, namespace):
    """Reconciler passes that evict a lower-priority replica (drain, stop) and place the higher one."""
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=4))
    cp.wait_nodes("node-a")
    low = {"name": "low", "priority": 0, "scaling": {"min": 1, "max": 1},
           "profiles": [{"engine": "sim", "tp": 4, "args": ["--tokens-per-second", "0"]}]}
    high = {"name": "high", "priority": 10, "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "sim", "tp": 4, "args": ["--tokens-per-second", "0"]}]}
    assert cp.apply({"models": [low]}).status_code == 200
    cp.wait_replicas("low", timeout_s=60)
    assert cp.apply({"models": [low, high]}).status_code == 200
    cp.wait_replicas("high", timeout_s=90)
    cp.wait_replicas("low", "stopped", timeout_s=30)
    assert len(export(temporal, namespace, "evict")) >= 4


def test_fenced_starts_and_stops(control_plane, temporal, namespace):
    """Issue 9's paths (tests/histories/v2-faults): starts that check they are still wanted and carry the
    fencing generation; a failed start; a stop decided while the replica fetches (the start is cancelled and
    waited for); a start failed by the planner past its start_timeout; a drain and stop of a Ready replica."""
    from tests.faults.slow_source import SlowSource

    source = SlowSource()
    try:
        cp = control_plane.start()
        cp.agent("node-a", simulate=sim_spec(gpus=4))
        cp.wait_nodes("node-a")

        def sim(name: str, **profile) -> dict:
            return {"name": name, "scaling": {"min": 1, "max": 1},
                    "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"], **profile}]}
        plain = sim("plain")
        assert cp.apply({"models": [plain]}).status_code == 200
        cp.wait_replicas("plain", timeout_s=60)
        broken = sim("broken", args=["--startup-delay", "not-a-number"])
        assert cp.apply({"models": [plain, broken]}).status_code == 200
        cp.wait_replicas("broken", "failed", timeout_s=60)
        slow = sim("slow", source=source.url("slow.bin"))
        assert cp.apply({"models": [plain, slow]}).status_code == 200
        cp.wait_replicas("slow", "starting", timeout_s=60)
        assert source.served_head.wait(60)
        assert cp.apply({"models": [plain]}).status_code == 200
        cp.wait_replicas("slow", "stopped", timeout_s=60)
        late = sim("late", source=source.url("late.bin"), start_timeout="3s")
        assert cp.apply({"models": [plain, late]}).status_code == 200
        cp.wait_replicas("late", "failed", timeout_s=60)
        assert cp.apply({"models": []}).status_code == 200
        cp.wait_replicas("plain", "stopped", timeout_s=60)
        wait_until(lambda: all(r["status"] in ("stopped", "failed") for r in cp.replicas()), timeout_s=60,
                   what="every replica ended")
        time.sleep(3)  # the last stops settle and their workflows close
    finally:
        source.close()
    assert len(export(temporal, namespace, "fenced")) >= 6

def test_rollout(control_plane, temporal, namespace):
    """A profile change: the RolloutWorkflow retires the old replica once the surge replica is Ready."""
    cp = control_plane.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")

    def catalog(tps: int) -> dict:
        return {"models": [{"name": "roll", "scaling": {"min": 1, "max": 1},
                            "profiles": [{"engine": "sim", "args": ["--tokens-per-second", str(tps)]}]}]}
    assert cp.apply(catalog(40)).status_code == 200
    [old] = cp.wait_replicas("roll", timeout_s=60)
    wait_until(lambda: all(r.get("profile_hash") for r in cp.replicas(all=False)), timeout_s=15, what="hashes")
    assert cp.apply(catalog(30)).status_code == 200
    cp.wait_replicas("roll", exclude={old["id"]}, timeout_s=60)
    wait_until(lambda: any(r["id"] == old["id"] and r["status"] == "stopped" for r in cp.replicas()), timeout_s=60,
               what="the old replica retired")
    assert export(temporal, namespace, "rollout", kinds=("RolloutWorkflow",))

def test_mirror_a_layout_and_fail_one(tmp_path, temporal, namespace):
    """`MirrorWorkflow`: a two-shard layout with a connection dropped mid-file (a retried fetch, progress
    signals, publish), the same again (already published), a canceled mirror and one that fails (a split
    GGUF with a part missing)."""
    import time

    from tests.test_mirror_workflow import MiB, Mirror, OriginProcess, gguf, layout

    layout(tmp_path / "origin" / "m", shards=2, shard_size=3 * MiB)
    (tmp_path / "origin" / "g-00001-of-00002.gguf").write_bytes(gguf(1000, "g"))
    (tmp_path / "logs").mkdir()
    origin = OriginProcess(tmp_path / "origin", tmp_path / "logs").start(
        rate=2_000_000, drop={"/m/model-00001-of-00002.safetensors": MiB})
    mirror = Mirror(tmp_path, temporal.address, namespace, "127.0.0.1/32")
    try:
        mirror.serve()
        assert mirror.cli("add", f"{origin.url}/m/").returncode == 0
        assert mirror.cli("add", f"{origin.url}/m/").returncode == 0  # published already: nothing fetched
        assert mirror.cli("add", f"{origin.url}/g-00001-of-00002.gguf").returncode == 1
        origin.kill()
        origin.start(rate=300_000)
        assert mirror.cli("add", f"{origin.url}/m/", "--name", "c", "--detach").returncode == 0
        time.sleep(2)
        assert mirror.cli("cancel", "c").returncode == 0
        assert len(export(temporal, namespace, "mirror")) == 4
    finally:
        mirror.stop()
        origin.kill()


def test_place_many_in_one_pass(control_plane, temporal, namespace):
    """A reconciler pass that places several replicas at once (v2: each accounted before the next), then a
    model removed (drain, stop) and the node of another killed (lost, cleanup, rebuilt)."""
    cp = control_plane
    cp.env.update(LLMGW_NODE_UNREACHABLE_AFTER_S="3", LLMGW_NODE_LOST_AFTER_S="8")
    cp.start()
    for n in ("node-a", "node-b", "node-c"):
        cp.agent(n, simulate=sim_spec(gpus=2))
    cp.wait_nodes("node-a", "node-b", "node-c")
    models = [{"name": f"m{i}", "scaling": {"min": 1, "max": 1},
               "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}
              for i in range(4)]
    assert cp.apply({"models": models}).status_code == 200
    for m in models:
        cp.wait_replicas(m["name"], timeout_s=90)
    assert cp.apply({"models": models[1:]}).status_code == 200
    cp.wait_replicas("m0", "stopped", timeout_s=60)
    lost = next(r for r in cp.replicas() if r["model"] == "m1" and r["status"] == "ready")
    cp.kill_node(lost["node_id"])
    cp.wait_replicas("m1", exclude={lost["id"]}, timeout_s=90)
    assert len(export(temporal, namespace, "place-many")) >= 6


def test_sleep_and_wake(control_plane, temporal, namespace):
    """Issue 39's workflows (tests/histories/v8): an idle replica put to sleep (`ReplicaSleepWorkflow`), a
    request that wakes it (`ReplicaWakeWorkflow`), asleep again."""
    cp = control_plane
    cp.env.update({"LLMGW_LOAD_WAIT_S": "30", "LLMGW_REPLICA_DRAIN_TIMEOUT_S": "5", "LLMGW_RECONCILE_INTERVAL_S": "1"})
    cp.start()
    cp.agent("node-a")
    cp.wait_nodes("node-a")
    sleepy = {"name": "sleepy", "scaling": {"min": 0, "max": 1, "sleep_after": 2, "idle_timeout": 600},
              "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0", "--sleep-s", "0.2", "--wake-s", "0.3"]}]}
    assert cp.apply({"models": [sleepy]}).status_code == 200
    assert chat(cp, "sleepy") == 200  # a cold start
    cp.wait_replicas("sleepy", "sleeping", 1, 30)
    assert chat(cp, "sleepy") == 200  # woken
    cp.wait_replicas("sleepy", "sleeping", 1, 30)
    time.sleep(2)  # the sleep workflow closes
    assert len(export(temporal, namespace, "sleep-wake", kinds=("ReplicaSleepWorkflow", "ReplicaWakeWorkflow"))) >= 3


def test_prestage(control_plane, temporal, namespace):
    """Pre-staging (tests/histories/v9): an on-demand model used and stopped for being idle, its node gone:
    its weights are staged on the other node (`StageWeightsWorkflow`), where the next request starts it."""
    cp = control_plane
    cp.start(mirror=True)
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    (cp.mirror_dir / "w.bin").write_bytes(b"w" * (1 << 20))
    agents = {n: cp.agent(n, simulate=sim_spec(gpus=1)) for n in ("node-a", "node-b")}
    cp.wait_nodes(*agents)
    od = {"name": "od", "scaling": {"min": 0, "max": 1, "idle_timeout": "3s"},
          "profiles": [{"engine": "sim", "source": "mirror:w.bin", "gpus_per_node": 1, "disk_gb": 1}]}
    assert cp.apply({"models": [od]}).status_code == 200
    assert chat(cp, "od") == 200
    [first] = cp.replicas()
    wait_until(lambda: all(r["status"] == "stopped" for r in cp.replicas()), timeout_s=60, what="od idle-stopped")
    agents[first["node_id"]].stop()
    other = next(n for n in agents if n != first["node_id"])
    wait_until(lambda: any(f.name.endswith("-w.bin") for f in (cp.state / "cache" / other).glob("*")), timeout_s=60,
               what="staged")
    time.sleep(3)  # its inventory reaches the control plane
    assert chat(cp, "od") == 200
    time.sleep(2)
    assert export(temporal, namespace, "prestage", kinds=("StageWeightsWorkflow",))
    assert export(temporal, namespace, "prestage", kinds=("ReplicaStartWorkflow",))
