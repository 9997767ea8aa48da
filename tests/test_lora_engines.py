"""LoRA on the engine side (issue 40): what vLLM and the sim engine are launched with for a profile with
`max_loras`, the policy keeping those flags the node worker's, and the sim engine's runtime load/unload calls
with vLLM's request and error shapes, its bound, its load time and its marker."""

from __future__ import annotations

import time

from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog.policy import profile_problems
from llmgw.engines.base import ShardSpec
from llmgw.engines.sim import SimAdapter
from llmgw.engines.sim_server import SimEngine, make_app
from llmgw.engines.vllm import VllmAdapter
from llmgw.schemas.catalog import Profile


def spec(profile: Profile) -> ShardSpec:
    return ShardSpec(shard_id="rep1-r0", replica_id="rep1", model="base", profile=profile, rank=0, gpus=[0],
                     weights_path=profile.source, host="10.0.0.1", port=8000)


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_with_max_loras_is_launched_with_lora_on_and_its_runtime_calls_open():
    plan = VllmAdapter("/opt/vllm/bin/vllm").build(spec(Profile(engine="vllm", source="org/m", max_loras=3,
                                                                max_lora_rank=32)))
    assert "--enable-lora" in plan.argv and after(plan.argv, "--max-loras") == "3"
    assert after(plan.argv, "--max-lora-rank") == "32"
    assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plan = VllmAdapter("/opt/vllm/bin/vllm").build(spec(Profile(engine="vllm", source="org/m", max_loras=1)))
    assert after(plan.argv, "--max-lora-rank") == "16"  # vLLM's default, said aloud
    plain = VllmAdapter("/opt/vllm/bin/vllm").build(spec(Profile(engine="vllm", source="org/m")))
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
    sim = SimAdapter().build(spec(Profile(engine="sim", max_loras=2)))
    assert after(sim.argv, "--max-loras") == "2"
    assert "--max-loras" not in SimAdapter().build(spec(Profile(engine="sim"))).argv


def test_the_lora_flags_and_variable_are_the_node_workers_not_the_profiles():
    for args, env in ((["--enable-lora"], {}), (["--max-loras", "9"], {}), (["--max_lora_rank=64"], {}),
                      ([], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})):
        assert profile_problems(Profile(engine="vllm", source="org/m", args=args, env=env)), (args, env)
    assert profile_problems(Profile(engine="sim", args=["--max-loras", "9"]))
    assert not profile_problems(Profile(engine="sim", args=["--lora-load-s", "0.5"]))


async def test_the_sim_engine_loads_and_unloads_adapters_as_vllm_does_and_its_answers_name_the_adapter():
    engine = SimEngine("base", 0, 0, max_loras=2, lora_load_s=0.2)
    client = TestClient(TestServer(make_app(engine, "k")))
    await client.start_server()
    auth = {"Authorization": "Bearer k"}

    async def load(name, path="/a"):
        return await client.post("/v1/load_lora_adapter", headers=auth, json={"lora_name": name, "lora_path": path})

    async def ask(model):
        r = await client.post("/v1/chat/completions", headers=auth, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        return r.status, await r.json()

    try:
        assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})).status == 401
        started = time.monotonic()
        r = await load("sql", "/adapters/sql")
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'sql' added successfully."
        assert time.monotonic() - started >= 0.2  # its load time
        status, body = await ask("sql")
        assert status == 200 and body["model"] == "sql" and body["system_fingerprint"] == "lora:sql"
        status, body = await ask("base")
        assert status == 200 and body["model"] == "base" and "system_fingerprint" not in body
        status, body = await ask("law")  # not loaded: vLLM's 404
        assert status == 404 and body["error"] == {"message": "The model `law` does not exist.",
                                                   "type": "NotFoundError", "param": None, "code": 404}
        r = await load("sql")
        assert r.status == 400 and (await r.json())["error"]["message"] == \
            "The lora adapter 'sql' has already been loaded."
        for bad in ({"lora_name": "x"}, {"lora_path": "/x"}, {"lora_name": "", "lora_path": "/x"},
                    {"lora_name": 5, "lora_path": "/x"}, {"lora_name": ["x"], "lora_path": "/x"}):
            r = await client.post("/v1/load_lora_adapter", headers=auth, json=bad)
            assert r.status == 400 and (await r.json())["error"]["type"] == "InvalidUserInput", bad
        r = await client.post("/v1/load_lora_adapter", headers=auth, data=b"{not json")
        assert r.status == 400
        assert (await load("law")).status == 200
        r = await load("third")  # past --max-loras: refused, the caller must unload one
        assert r.status == 400 and "max_loras is 2" in (await r.json())["error"]["message"]
        models = await (await client.get("/v1/models", headers=auth)).json()
        assert [(m["id"], m.get("parent"), m.get("root")) for m in models["data"]] == [
            ("base", None, None), ("sql", "base", "/adapters/sql"), ("law", "base", "/a")]
        r = await client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "sql"})
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'sql' removed successfully."
        r = await client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "sql"})
        assert r.status == 404 and (await r.json())["error"]["message"] == "The lora adapter 'sql' cannot be found."
        r = await client.post("/v1/unload_lora_adapter", headers=auth, json={})
        assert r.status == 400
        assert (await load("third")).status == 200
        assert (await ask("sql"))[0] == 404
    finally:
        await client.close()


async def test_a_sim_engine_without_max_loras_refuses_loads_and_serves_any_model_name_as_before():
    engine = SimEngine("base", 0, 0)
    client = TestClient(TestServer(make_app(engine)))
    await client.start_server()
    try:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert r.status == 400 and "LoRA is not enabled" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and (await r.json())["model"] == "base"
    finally:
        await client.close()
