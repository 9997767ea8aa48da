"""Sleep on the engine side (issue 39): which engines sleep, what vLLM is launched with to sleep and how its
sleep endpoints are held to the engine key, the sim engine's sleep calls and the memory it reports, and the
new payload fields left out while they hold their defaults (a 0.1.0 process refuses unknown fields)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw.engines.base import ShardSpec, SleepError
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.sglang import SglangAdapter
from llmgw.engines.sim import SimAdapter
from llmgw.engines.sim_server import SimEngine, make_app
from llmgw.engines.vllm import GUARD, GUARD_DIR, VllmAdapter
from llmgw.engines.vllm_guard.llmgw_vllm_guard import KeyEveryPath
from llmgw.schemas.catalog import SLEEPING_ENGINES, Profile
from llmgw.schemas.payloads import AwaitStartClosedInput, LaunchShardInput, PassAction, ReplicaStartInput
from llmgw.schemas.status import ReplicaStatus


def test_the_adapters_and_the_catalog_agree_on_which_engines_sleep():
    adapters = {"vllm": VllmAdapter("/bin/true"), "sglang": SglangAdapter(), "llamacpp": LlamaCppAdapter("/bin/true"),
                "sim": SimAdapter()}
    assert sorted(n for n, a in adapters.items() if a.sleeps) == sorted(SLEEPING_ENGINES)
    assert Profile(engine="llamacpp", source="x.gguf").sleep_refusal() == \
        "llamacpp has no sleep mode (it keeps running until idle_timeout)"
    assert "on the CPU" in Profile(engine="vllm", source="org/m", device="cpu").sleep_refusal()
    assert Profile(engine="vllm", source="org/m", gpu_memory_gb=20).sleep_refusal() is None
    assert Profile(engine="sim").sleep_refusal() is None


async def test_llamacpp_says_it_has_no_sleep():
    async with aiohttp.ClientSession() as s:
        with pytest.raises(SleepError, match="llamacpp has no sleep mode"):
            await LlamaCppAdapter("/bin/true").sleep(s, "http://127.0.0.1:1", "k")


def _spec(profile: Profile, sleep_mode: bool) -> ShardSpec:
    return ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=profile, weights_path="/w", port=9,
                     api_key="k", sleep_mode=sleep_mode)


def test_vllm_is_launched_able_to_sleep_only_when_asked_and_behind_its_key_on_every_path():
    gpu = Profile(engine="vllm", source="org/m", gpu_memory_gb=20)
    plain = VllmAdapter("/bin/vllm").build(_spec(gpu, False))
    assert "--enable-sleep-mode" not in plain.argv and "--middleware" not in plain.argv
    assert "VLLM_SERVER_DEV_MODE" not in plain.env and "PYTHONPATH" not in plain.env
    able = VllmAdapter("/bin/vllm").build(_spec(gpu, True))
    assert able.argv[-3:] == ["--middleware", GUARD, "--enable-sleep-mode"]
    assert able.env["VLLM_SERVER_DEV_MODE"] == "1" and able.env["PYTHONPATH"] == str(GUARD_DIR)
    assert sorted(p.name for p in GUARD_DIR.iterdir() if p.suffix == ".py") == ["llmgw_vllm_guard.py"]
    # The CPU build refuses --enable-sleep-mode ("not supported on current platform"): never given there.
    cpu = VllmAdapter("/bin/vllm").build(_spec(Profile(engine="vllm", source="org/m", device="cpu"), True))
    assert "--enable-sleep-mode" not in cpu.argv
    sglang = SglangAdapter("/bin/python").build(_spec(Profile(engine="sglang", source="org/m"), True))
    assert "--enable-memory-saver" in sglang.argv


async def test_the_vllm_guard_refuses_every_path_without_the_engine_key():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(guard, path: str, auth: str | None) -> int:
        out = []

        async def send(msg):
            out.append(msg)
        headers = [(b"authorization", auth.encode())] if auth is not None else []
        await guard({"type": "http", "path": path, "headers": headers}, None, send)
        return out[0]["status"]

    guard = KeyEveryPath(app, key="sekrit")
    for path in ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/health", "/v1/models"):
        assert await call(guard, path, None) == 401
        assert await call(guard, path, "Bearer wrong") == 401
        assert await call(guard, path, "Basic sekrit") == 401
        assert await call(guard, path, "Bearer " + "x" * 100_000) == 401
        assert await call(guard, path, "Bearer sekrit") == 200
    assert await call(KeyEveryPath(app, key=""), "/sleep", None) == 200  # no key: as vLLM without one
    assert seen.count("/sleep") == 2


async def test_the_sim_engine_sleeps_as_vllm_does_and_reports_the_memory_it_holds():
    engine = SimEngine("m", 0, 0, gpu_memory_mb=64, sleep_s=0.05, wake_s=0.05)
    client = TestClient(TestServer(make_app(engine, "k")))
    await client.start_server()
    auth = {"Authorization": "Bearer k"}
    try:
        assert (await client.post("/sleep")).status == 401  # held to its key like every call
        state = await (await client.get("/is_sleeping", headers=auth)).json()
        assert state == {"is_sleeping": False, "level": 0, "accelerator_memory_bytes": 64 << 20,
                         "offloaded_memory_bytes": 0}
        for bad in ("3", "0", "-1", "x", "1e9"):
            r = await client.post(f"/sleep?level={bad}", headers=auth)
            assert r.status == 422 and (await r.json())["error"]["param"] == "level"
        assert (await (await client.post("/sleep?level=1", headers=auth)).json())["status"] == "sleeping"
        state = await (await client.get("/is_sleeping", headers=auth)).json()
        assert state["is_sleeping"] and state["accelerator_memory_bytes"] == 0
        assert state["offloaded_memory_bytes"] == 64 << 20
        assert "sim:accelerator_memory_bytes 0" in await (await client.get("/metrics", headers=auth)).text()
        assert (await client.get("/health", headers=auth)).status == 200  # alive, asleep
        # A request while asleep waits until it is woken, then is answered.
        held = asyncio.ensure_future(client.post("/v1/chat/completions", headers=auth, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        await asyncio.sleep(0.2)
        assert not held.done()
        assert (await (await client.post("/wake_up", headers=auth)).json())["status"] == "awake"
        assert (await held).status == 200
        state = await (await client.get("/is_sleeping", headers=auth)).json()
        assert not state["is_sleeping"] and state["accelerator_memory_bytes"] == 64 << 20
        assert (await client.post("/wake_up", headers=auth)).status == 200  # awake already: a no-op
        await client.post("/sleep?level=2", headers=auth)
        state = await (await client.get("/is_sleeping", headers=auth)).json()
        assert state["level"] == 2 and state["offloaded_memory_bytes"] == 0  # level 2 drops the weights
        async with aiohttp.ClientSession() as s:  # and the adapter's calls, with its key
            base = str(client.make_url("")).rstrip("/")
            await SimAdapter().wake(s, base, "k")
            await SimAdapter().sleep(s, base, "k", 1)
            with pytest.raises(SleepError, match="answered 401"):
                await SimAdapter().wake(s, base, "wrong")
    finally:
        await client.close()


def test_new_payload_fields_are_left_out_while_they_hold_their_defaults():
    p = Profile(engine="sim")
    for model, field in ((LaunchShardInput(shard_id="s", replica_id="r", model="m", profile=p), "sleep_mode"),
                         (ReplicaStartInput(replica_id="r", model="m", profile=p, shards=[]), "sleep_mode"),
                         (PassAction(kind="stop", model="m", line="x"), "sleep_mode"),
                         (AwaitStartClosedInput(replica_id="r"), "workflow")):
        assert field not in json.loads(model.model_dump_json()), type(model).__name__
    assert json.loads(LaunchShardInput(shard_id="s", replica_id="r", model="m", profile=p, sleep_mode=True)
                      .model_dump_json())["sleep_mode"] is True


def test_a_sleeping_replica_is_woken_only_by_its_wake_and_holds_its_room():
    assert ReplicaStatus.SLEEPING in ReplicaStatus.holding() and ReplicaStatus.SLEEPING not in ReplicaStatus.live()
    assert ReplicaStatus.SLEEPING.can_become(ReplicaStatus.READY) and ReplicaStatus.READY.can_become("sleeping")
    assert not ReplicaStatus.STARTING.can_become("sleeping")
    for end in (ReplicaStatus.STOPPED, ReplicaStatus.FAILED, ReplicaStatus.LOST, ReplicaStatus.DRAINING):
        assert ReplicaStatus.SLEEPING.can_become(end)
    assert ReplicaStatus.SLEEPING not in ReplicaStatus.fencing()  # sleeping is no step towards stopping
