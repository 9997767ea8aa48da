"""README command 1 for real: `llmgw dev` with embedded Postgres and Temporal, llama-server serving
SmolLM2-135M (fetched through the mirror) and the sim engine, driven with the official openai client.

Marked e2e so it can run alone (`pytest -m e2e`); CI runs it with everything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from openai import OpenAI
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw.dev.procs import free_port
from tests.helpers import sweep_engines, wait_until

pytestmark = pytest.mark.e2e

MODELS = {"smollm2-135m", "sim-small"}


class Dev:
    """One `llmgw dev` process on free ports with its own state directory."""

    def __init__(self, state: Path, ports: dict[str, int], log: Path):
        self.state, self.ports, self.log_path = state, ports, log
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update({"LLMGW_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1",
                    **{f"LLMGW_{k.upper()}_PORT": str(v) for k, v in ports.items()}})
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "dev"], env=self.env, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self.proc

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "llmgw dev is up" in self.output():
                return
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"llmgw dev exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            time.sleep(0.5)
        raise AssertionError("llmgw dev did not come up:\n" + self.output()[-4000:])

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The admin token `llmgw dev`'s server created in its state directory (always required)."""
        return {"authorization": "Bearer " + (self.state / "admin.token").read_text().strip()}

    def replicas(self) -> list[dict]:
        return httpx.get(self.admin + "/admin/v1/replicas?all=true", timeout=10, headers=self.admin_headers).json()

    def ready(self, model: str) -> list[dict]:
        return [r for r in self.replicas() if r["model"] == model and r["status"] == "ready"]

    def failures(self, model: str) -> str:
        """What `ctl replicas --all` shows for `model`'s replicas that did not serve: the failure text."""
        bad = [r for r in self.replicas() if r["model"] == model and r["status"] in ("failed", "lost")]
        if not bad:
            return f"{model}: no failed replica; replicas: " + ", ".join(f"{r['id'][:8]} {r['status']}" for r in self.replicas())
        return "\n".join(f"{model} replica {r['id'][:8]} {r['status']}: {r.get('failure') or r.get('ended_reason')}"
                         for r in bad[:3])

    def descendants(self) -> list[psutil.Process]:
        assert self.proc
        return psutil.Process(self.proc.pid).children(recursive=True)

    def interrupt(self, timeout_s: float = 90) -> int:
        assert self.proc
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout_s)

    def kill_all(self) -> None:
        if self.proc and self.proc.poll() is None:
            for p in self.descendants():
                try:
                    p.kill()
                except psutil.Error:
                    pass
            self.proc.kill()
            self.proc.wait(10)
        sweep_engines(self.state)


@pytest.fixture
def dev(tmp_path):
    ports = {k: free_port() for k in ("gateway", "admin", "mirror", "node_api", "temporal", "temporal_ui", "postgres", "agent_metrics",
                                     "control_metrics")}
    # The state (with Postgres data, run as another user when root) lives outside pytest's tmp tree, whose
    # root every pytest session resets to mode 0700.
    state = Path(tempfile.mkdtemp(prefix="llmgw-test-dev-"))
    d = Dev(state, ports, tmp_path / "dev.log")
    try:
        yield d
    finally:
        d.kill_all()
        shutil.rmtree(state, ignore_errors=True)


def completions_work(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
    assert r.choices[0].message.content.strip(), f"{model}: empty answer"
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=16, stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text.strip(), f"{model}: empty streamed answer"
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
    assert r.choices[0].text.strip(), f"{model}: empty completion"


def start_workflows(temporal_port: int, node: str) -> list[tuple[str, set[str]]]:
    """(workflow id, task queues of its node activities) for every completed ReplicaStartWorkflow."""
    async def go():
        client = await Client.connect(f"127.0.0.1:{temporal_port}")
        out = []
        async for wf in client.list_workflows("WorkflowType = 'ReplicaStartWorkflow' AND ExecutionStatus = 'Completed'"):
            h = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            queues = {e.activity_task_scheduled_event_attributes.task_queue.name for e in h.events
                      if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                      and e.activity_task_scheduled_event_attributes.activity_type.name
                      in ("fetch_weights", "launch_shard", "start_shard", "wait_shard_ready")}
            out.append((wf.id, queues))
        return out
    return asyncio.run(go())


def model_workflows(temporal_port: int, model: str) -> set[str]:
    """Ids of the workflows the Temporal UI's query `LlmgwModel = "<model>"` lists."""
    async def go():
        client = await Client.connect(f"127.0.0.1:{temporal_port}")
        return {wf.id async for wf in client.list_workflows(f'LlmgwModel = "{model}"')}
    return asyncio.run(go())


def engine_pid(state: Path, replica_id: str) -> int:
    spec = next(state.glob(f"shards/*/{replica_id}-r0.json"))
    return json.loads(spec.read_text())["pid"]


def test_llmgw_dev_serves_smollm2_and_sim_end_to_end(dev):
    dev.start()
    dev.wait_up()
    client = OpenAI(base_url=dev.gateway + "/v1", api_key="unused")

    # Both models listed; both become Ready through Temporal on the local node.
    ids = {m.id: m.owned_by for m in client.models.list().data}
    assert set(ids) == MODELS
    assert ids["sim-small"] == "llmgw-sim" and ids["smollm2-135m"] == "llmgw"
    for m in MODELS:
        wait_until(lambda m=m: dev.ready(m), timeout_s=120, what=f"{m} ready", why=lambda m=m: dev.failures(m))
    for m in MODELS:
        wait_until(lambda m=m: httpx.post(dev.gateway + "/v1/chat/completions", timeout=60, json={
            "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code == 200,
            timeout_s=30, what=f"gateway route to {m}")
        completions_work(client, m)

    # A prompt far longer than smollm2's context (--ctx-size 4096 over --parallel 2 slots: 2,048 tokens a request,
    # as llama-server logs `n_ctx_slot = 2048`) is refused by the gateway at once, not
    # after llama-server has tokenized it in a slot (a 50 MB prompt held one for 59.5 s). One within the
    # gateway's coarse bound (32 characters a token) but past the context is still the engine's to refuse.
    def ask(text: str) -> httpx.Response:
        return httpx.post(dev.gateway + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    refused = ask("word " * 1_000_000)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text
    assert "its context is 2,048 tokens a request" in refused.json()["error"]["message"]
    past = ask("word " * 12_000)  # 60,000 characters, about 12,000 tokens: llama-server's words, OpenAI's code
    assert past.status_code == 400 and past.json()["error"]["code"] == "context_length_exceeded", past.text
    assert "exceeds the available context size" in past.json()["error"]["message"], past.text
    assert "try increasing it" not in past.json()["error"]["message"]
    # An image for llama-server without a projector: 400 from the gateway, not the engine's 500 as a 502.
    image = httpx.post(dev.gateway + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert image.status_code == 400 and image.json()["error"]["code"] == "unsupported_content", image.text
    assert ask("hi").status_code == 200

    # One completed replica-start workflow per replica, its node activities on the node's queue.
    wfs = start_workflows(dev.ports["temporal"], "local")
    started = {r["id"] for r in dev.replicas()}
    assert {wid.split("/")[1] for wid, _ in wfs} == started
    assert all(queues == {"node/local"} for _, queues in wfs), wfs
    # The Temporal UI finds a model's whole history by its search attribute (`llmgw dev` registers them).
    smol = {f"replica/{r['id']}/start" for r in dev.replicas() if r["model"] == "smollm2-135m"}
    wait_until(lambda: smol <= model_workflows(dev.ports["temporal"], "smollm2-135m"), timeout_s=20,
               what='LlmgwModel = "smollm2-135m" listing its start workflows')
    # The weights came through the mirror into the node's cache, named by a hash of the source.
    cached = list((dev.state / "cache").glob("*-SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert len(cached) == 1 and cached[0].stat().st_size > 90_000_000

    # Killing the engine takes the replica out of routing within seconds; the reconciler starts another.
    [old] = dev.ready("smollm2-135m")
    killed_at = time.monotonic()
    os.kill(engine_pid(dev.state, old["id"]), signal.SIGKILL)
    wait_until(lambda: all(r["status"] != "ready" for r in dev.replicas() if r["id"] == old["id"]),
               timeout_s=5, interval_s=0.1, what="killed replica out of routing")
    assert time.monotonic() - killed_at < 5
    wait_until(lambda: [r for r in dev.ready("smollm2-135m") if r["id"] != old["id"]], timeout_s=60,
               what="a replacement replica", why=lambda: dev.failures("smollm2-135m"))
    wait_until(lambda: httpx.post(dev.gateway + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code == 200,
        timeout_s=30, what="traffic on the replacement")
    # `ctl models` counts it, while the model is ready again (its failed starts in a row are back to 0).
    listed = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "models"], env=dev.env, capture_output=True,
                            text=True, timeout=60)
    [smol] = [line for line in listed.stdout.splitlines() if line.startswith("smollm2-135m ")]
    assert smol.split()[1:4] == ["ready", "1/1", "1"], smol

    # A second `llmgw dev` on the same state refuses instead of starting duplicates.
    second = subprocess.run([sys.executable, "-m", "llmgw", "dev"], env=dev.env, capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert "already running" in second.stderr + second.stdout

    # A change made with `llmgw ctl apply` survives the next start (the catalog file did not change).
    changed = dev.state / "changed.yaml"
    cat = yaml.safe_load((dev.state / "catalog.yaml").read_text())
    next(m for m in cat["models"] if m["name"] == "sim-small")["aliases"] = ["greek"]
    changed.write_text(yaml.safe_dump(cat))
    applied = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "apply", "-f", str(changed), "--yes"],
                             env=dev.env, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr

    # Ctrl-C stops every process it started, engines included.
    def replaced() -> dict[str, int]:
        views = httpx.get(dev.admin + "/admin/v1/models", timeout=10, headers=dev.admin_headers).json()
        return {v["name"]: v["replaced"] for v in views if v["name"] in MODELS}
    replaced_before = replaced()
    procs = dev.descendants()
    assert any("llama-server" in " ".join(p.cmdline()) for p in procs)
    assert dev.interrupt() == 0
    time.sleep(1)
    left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline()) for p in left]

    # Started again, it reuses the state: the mirror file is not fetched again, the catalog is unchanged,
    # and both models serve again.
    mirror_file = dev.state / "mirror" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    mtime = mirror_file.stat().st_mtime_ns
    dev.log_path.write_text("")
    dev.start()
    dev.wait_up()
    assert "is unchanged since the last start; keeping the control plane's catalog (2 models, `llmgw ctl apply` " \
        "changes included: sim-small changed)" in dev.output(), dev.output()
    assert mirror_file.stat().st_mtime_ns == mtime
    catalog_now = httpx.get(dev.admin + "/admin/v1/catalog", timeout=10, headers=dev.admin_headers).json()
    assert next(m for m in catalog_now["models"] if m["name"] == "sim-small")["aliases"] == ["greek"]
    for m in MODELS:
        wait_until(lambda m=m: dev.ready(m), timeout_s=120, what=f"{m} ready after restart",
                   why=lambda m=m: dev.failures(m))
        wait_until(lambda m=m: httpx.post(dev.gateway + "/v1/chat/completions", timeout=60, json={
            "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200,
            timeout_s=30, what=f"{m} served after restart")
    # A clean stop is no failure: the agent said it leaves to a node API still running, so the replicas it
    # stopped are not counted as replaced (`ctl models` RESTARTS; had the node API gone first, the restart
    # found them lost).
    assert replaced() == replaced_before, (replaced(), replaced_before)
    assert dev.interrupt() == 0
