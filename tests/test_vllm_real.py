"""A real vLLM (its CPU build, `scripts/setup --with vllm`) under llmgw, through the real path: control plane,
agent, mirror, gateway and a `vllm serve` process. One vLLM replica is shared by the module (each start costs
about 95 s on two shared cores).

Skipped when vLLM is not installed, unless `LLMGW_REQUIRE_VLLM=1` (CI sets it), which makes a missing vLLM
fail instead, as `LLMGW_REQUIRE_BROWSER` does for the browser test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import psutil
import pytest

from llmgw.engines.vllm import find_vllm
from tests.helpers import ControlPlane, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MODEL = "smol-vllm"
START_S = 900  # a cold vLLM start on two cores shared with the rest of a test run
# `--optimization-level 0`: no torch.compile warm-up (six minutes and more on two loaded cores; ~3 s without).
ARGS = ["--max-model-len", "1024", "--dtype", "bfloat16", "--optimization-level", "0"]


def _vllm_or_skip() -> str:
    exe = find_vllm(None)
    if exe is None:
        if os.environ.get("LLMGW_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is required here (LLMGW_REQUIRE_VLLM=1) but not installed: run scripts/setup --with vllm")
        pytest.skip("vLLM is not installed (scripts/setup --with vllm)")
    return exe


def profile(**over) -> dict:
    p = {"engine": "vllm", "device": "cpu", "source": "mirror:smollm2-hf/", "memory_gb": 4,
         "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "args": ARGS, "start_timeout": START_S}
    p.update(over)
    return p


def catalog(*extra: dict) -> dict:
    return {"models": [{"name": MODEL, "scaling": {"min": 1, "max": 1}, "profiles": [profile()]}, *extra]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, module_database_url, temporal):
    exe = _vllm_or_skip()
    from llmgw.engines.vllm_selftest import converted_model

    model_dir = converted_model(Path(exe).parent / "python")
    namespace = temporal.free_namespaces.pop(0)
    cp = ControlPlane(tmp_path_factory.mktemp("vllm"), module_database_url, temporal.address,
                      LLMGW_TEMPORAL_NAMESPACE=namespace, LLMGW_VLLM=exe)
    try:
        shutil.copytree(model_dir, cp.mirror_dir / "smollm2-hf")  # a published mirror version (a directory)
        cp.start(mirror=True)
        agent = cp.agent("cpu-1", stop_engines_on_exit=False)
        assert cp.apply(catalog()).status_code == 200
        [rep] = cp.wait_replicas(MODEL, timeout_s=START_S)
        yield cp, agent, rep
    finally:
        cp.stop()


def shard_spec(cp: ControlPlane, rep: dict) -> dict:
    return json.loads((cp.state / "shards" / "cpu-1" / f"{rep['id']}-r0.json").read_text())


def chat(base: str, max_tokens: int = 8, **kw):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=max_tokens, temperature=0, **kw)


def test_a_cpu_vllm_model_is_placed_fetched_launched_with_its_key_and_served(fleet):
    cp, agent, rep = fleet
    assert "vllm: " in agent.log() and "/vllm" in agent.log()  # the agent says which vllm it launches
    r = chat(cp.gateway)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    from openai import OpenAI

    client = OpenAI(base_url=cp.gateway + "/v1", api_key="unused", timeout=120, max_retries=0)
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.choices[0].text
    pieces = [c.choices[0].delta.content or "" for c in chat(cp.gateway, stream=True) if c.choices]
    assert "".join(pieces)
    # the engine itself refuses anyone without its key: only the gateway holds it
    spec = shard_spec(cp, rep)
    assert httpx.get(spec["endpoint"] + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(spec["endpoint"] + "/v1/models", headers={"Authorization": f"Bearer {spec['api_key']}"},
                     timeout=10).status_code == 200


def test_anthropic_messages_are_passed_through_to_vllm(fleet):
    """vLLM 0.32 serves `/v1/messages` itself (gateway/dialects.py reads its `/version`): the gateway sends the
    request as it came and relays vLLM's answer, whose id is vLLM's own (a translation's would be `msg_` + the
    chat id), with the unmodified anthropic client, streaming too."""
    import anthropic

    cp, _, _ = fleet
    client = anthropic.Anthropic(base_url=cp.gateway, api_key="unused", timeout=120, max_retries=0)
    hello = [{"role": "user", "content": "Say hello."}]
    msg = client.messages.create(model=MODEL, max_tokens=4, messages=hello)
    assert msg.content[0].type == "text" and msg.content[0].text and not msg.id.startswith("msg_chatcmpl"), msg
    assert 0 < msg.usage.output_tokens <= 4 and msg.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=4, messages=hello) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and not final.id.startswith("msg_chatcmpl"), final
    assert 0 < final.usage.output_tokens <= 4


def test_vllm_s_own_metrics_are_read_for_load(fleet):
    """`vllm:num_requests_running`, read with the engine key, is what scaling and drains count."""
    import asyncio

    import aiohttp

    from llmgw.engines.vllm import VllmAdapter

    cp, _, rep = fleet
    spec = shard_spec(cp, rep)
    base = spec["endpoint"]

    async def running() -> int | None:
        async with aiohttp.ClientSession() as s:
            return await VllmAdapter().in_flight(s, base, spec["api_key"])

    assert asyncio.run(running()) == 0
    # and its queue, which the gateway reads as saturation (gateway/engine_queues.py), under the name it uses
    from llmgw.engines.queue_gauges import waiting
    page = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {spec['api_key']}"}, timeout=10).text
    assert waiting("vllm", page) == 0, [ln for ln in page.splitlines() if "waiting" in ln][:5]
    import threading

    # vLLM's own `ignore_eos`: the answer runs its full length, so it is in flight long enough to be seen
    t = threading.Thread(target=lambda: chat(cp.gateway, max_tokens=200, extra_body={"ignore_eos": True}))
    t.start()
    try:
        wait_until(lambda: (asyncio.run(running()) or 0) >= 1, timeout_s=60, interval_s=0.1,
                   what="vLLM counting the request in flight")
    finally:
        t.join()


def test_a_restarted_agent_adopts_the_running_vllm(fleet):
    cp, agent, rep = fleet
    pid = cp.shard_pid("cpu-1", f"{rep['id']}-r0")
    agent.stop()  # SIGTERM without --stop-engines-on-exit: vLLM keeps running
    assert psutil.pid_exists(pid)
    again = cp.agent("cpu-1", name="agent-cpu-1-again", stop_engines_on_exit=False)
    wait_until(lambda: "registered node cpu-1 (1 shard(s) running" in again.log(), timeout_s=60, what="re-registration")
    assert cp.shard_pid("cpu-1", f"{rep['id']}-r0") == pid and psutil.pid_exists(pid)
    assert [(r["id"], r["status"]) for r in cp.replicas() if r["model"] == MODEL] == [(rep["id"], "ready")]
    assert chat(cp.gateway).choices[0].message.content


def test_a_vllm_that_exits_at_start_fails_its_replica_with_vllm_s_own_error(fleet):
    cp, _, _ = fleet
    bad = {"name": "smol-bad", "scaling": {"min": 1, "max": 1},
           "profiles": [profile(args=[*ARGS[:2], "--dtype", "not-a-dtype", *ARGS[4:]])]}
    assert cp.apply(catalog(bad)).status_code == 200
    failed = wait_until(lambda: next((r for r in cp.replicas() if r["model"] == "smol-bad" and r["status"] == "failed"),
                                     None), timeout_s=300, what="the bad vLLM's replica failed", why=cp.logs)
    assert "not-a-dtype" in failed["failure"] and "invalid choice" in failed["failure"], failed["failure"]
    logs = cp.ctl("logs", failed["id"], timeout_s=60)
    assert "not-a-dtype" in logs.stdout, logs.stdout + logs.stderr
    assert cp.apply(catalog()).status_code == 200  # the bad model goes; the good replica is untouched


def test_removing_the_model_drains_vllm_s_request_in_flight_before_the_stop(fleet):
    """Last in the module: the drain reads vLLM's own `num_requests_running` and waits for it to reach 0."""
    import threading

    cp, _, rep = fleet
    pid = cp.shard_pid("cpu-1", f"{rep['id']}-r0")
    result: dict = {}

    def long_answer() -> None:
        try:
            result["r"] = chat(cp.gateway, max_tokens=200, extra_body={"ignore_eos": True})
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=long_answer)
    t.start()
    try:
        wait_until(lambda: any(r["model"] == MODEL for r in cp.replicas(all=False)) and "r" not in result
                   and _running(shard_spec(cp, rep)) >= 1, timeout_s=60, interval_s=0.1, what="the request in vLLM")
        assert cp.apply({"models": []}).status_code == 200
    finally:
        t.join(180)
    assert "error" not in result, result
    r = result["r"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200  # whole, not cut
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               timeout_s=120, what="vLLM stopped after the drain")


def _running(spec: dict) -> int:
    import asyncio

    import aiohttp

    from llmgw.engines.vllm import VllmAdapter

    async def read() -> int | None:
        async with aiohttp.ClientSession() as s:
            return await VllmAdapter().in_flight(s, spec["endpoint"], spec["api_key"])

    return asyncio.run(read()) or 0
