"""The operator's view of a model whose engine dies at start (issue 14), through the real control plane,
agent, gateway, Temporal and CLI: a stand-in llama-server that kills itself with SIGILL (as a native
llama.cpp build does on a CPU whose kernel forbids AMX), beside a sim model that serves.

The cause ("killed by SIGILL (illegal instruction)") reaches `ctl models` (status failing, RESTARTS, the
backoff left), `ctl replicas` (its latest failed replica, listed without --all), `ctl logs` (the engine's
own output, read on the node), the gateway's 503 (`model_failing`, Retry-After = the backoff left) and
`/v1/models` (what the chat page shows); its workflows are found in Temporal by `LlmgwModel = "m"`; the
control worker and the agent export the control-plane metrics; `ctl retry` starts it again at once.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import stat
import subprocess
import sys
import time

import httpx
import pytest
from temporalio.client import Client

from llmgw.dev.procs import free_port
from llmgw.dev.temporal_server import TemporalDevServer
from tests.helpers import ControlPlane, wait_until
from tests.test_engine_exits import FAKE_SERVER

pytestmark = pytest.mark.integration
SIGILL = "killed by SIGILL (illegal instruction)"


def sigill_server(tmp_path) -> str:
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, ready_first=False, serve_s=0))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return str(fake)


def catalog(weights: str) -> dict:
    return {"models": [
        {"name": "m", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "llamacpp", "source": weights}]},
        {"name": "s", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]},
    ]}


def model_view(cp: ControlPlane, name: str) -> dict:
    return next(m for m in httpx.get(cp.admin + "/admin/v1/models", timeout=10, headers=cp.admin_headers).json() if m["name"] == name)


def row(table: str, first: str) -> str:
    """The table row whose first cell is `first`."""
    return next(line for line in table.splitlines() if line.split() and line.split()[0] == first)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)$"
    m = re.search(pattern, text, re.M)
    assert m, f"{name}{{{want}}} not in metrics"
    return float(m.group(1))


async def workflows(address: str, namespace: str, query: str) -> list:
    client = await Client.connect(address, namespace=namespace)
    return [wf async for wf in client.list_workflows(query)]


def test_a_model_that_dies_at_start_shows_its_cause_everywhere(control_plane, tmp_path, temporal, namespace):
    cp = control_plane
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    control_port, agent_port = free_port(), free_port()
    # A long backoff: the model stays failing while we look (the first failure holds it 60-180 s).
    cp.env.update(LLMGW_START_BACKOFF_BASE_S="120", LLMGW_CONTROL_METRICS_PORT=str(control_port))
    cp.start()
    cp.agent("n1", LLMGW_LLAMA_SERVER=sigill_server(tmp_path), LLMGW_AGENT_METRICS_PORT=str(agent_port))
    cp.wait_nodes("n1")
    assert cp.apply(catalog(str(weights))).status_code == 200

    def failing():
        m = model_view(cp, "m")
        return m if m["status"] == "failing" and m["restarts"] >= 1 and m["retry_in_s"] else None

    m = wait_until(failing, timeout_s=90, what="m failing", why=cp.logs)
    assert SIGILL in m["reason"] and "rank 0 on n1" in m["reason"], m
    cp.wait_replicas("s", timeout_s=60)

    # ctl models: a header, AGE, and the failing model with RESTARTS, its cause and the backoff left.
    out = cp.ctl("models")
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0].split()
    assert header[:4] == ["MODEL", "STATUS", "READY", "RESTARTS"] and "AGE" in header, out.stdout
    line = row(out.stdout, "m")
    assert " failing " in line and SIGILL in line and "next start in" in line, line
    assert line.split()[3] == str(m["replaced"]) == str(m["restarts"]) == "1"  # one failed, nothing else yet
    assert "failed 1 time(s) in a row, next start in" in line, line
    assert " ready " in row(out.stdout, "s")

    # ctl replicas, without --all: the failed replica is listed with its cause.
    out = cp.ctl("replicas")
    [failed] = [line for line in out.stdout.splitlines()[1:] if line.split()[1] == "m"]
    assert " failed " in failed and SIGILL in failed and "next start in" in failed, out.stdout
    # RESTARTS is the model's count alone (`ctl models`, the fleet page); the replica says the count in a row as
    # `ctl models` does, never a second number under the same name.
    assert "RESTARTS" not in out.stdout.splitlines()[0] and "failed 1 time(s) in a row, next start in" in failed, failed
    assert any(line.split()[1] == "s" and " ready " in line for line in out.stdout.splitlines()[1:])
    rid = failed.split()[0]
    reps = json.loads(cp.ctl("replicas", "-o", "json").stdout)
    [rep] = [r for r in reps if r["model"] == "m"]
    assert rep["id"].startswith(rid) and SIGILL in rep["cause"] and "tinygemm_kernel_amx" in rep["failure"]
    assert rep["shards"][0]["exit_code"] == -4 and rep["shards"][0]["exit_reason"].startswith(SIGILL)
    wide = cp.ctl("replicas", "-o", "wide").stdout
    assert "TEMPORAL" in wide.splitlines()[0] and "LlmgwReplica%3D%22" + rep["id"] in wide

    # ctl logs: the engine's own output, read on the node by its worker.
    out = cp.ctl("logs", rid)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert "system_info: n_threads = 2" in out.stdout and "tinygemm_kernel_amx" in out.stdout
    assert cp.ctl("logs", rid, "--tail", "1").stdout.strip() == "tinygemm_kernel_amx"
    out = cp.ctl("logs", rid, "--rank", "3")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no shard of rank 3" in out.stderr
    out = cp.ctl("logs", "ffffffff")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no replica whose id starts with" in out.stderr
    for path, code in ((f"{'x' * 200}/logs", "bad_replica_id"), ("..%2F..%2Fetc/logs", None),
                       (f"{rid}/logs?rank=99999", "bad_request"), (f"{rid}/logs?limit=0", "bad_request"),
                       (f"{rid}/logs?offset=-7", "bad_request")):
        r = httpx.get(f"{cp.admin}/admin/v1/replicas/{path}", timeout=10, headers=cp.admin_headers)
        assert r.status_code in (400, 404) and "error" in r.json(), (path, r.status_code, r.text)
        assert code is None or r.json()["error"]["code"] == code, (path, r.text)

    # The gateway: 503 model_failing with the cause, Retry-After the backoff left; "loading" it is not.
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    left = model_view(cp, "m")["retry_in_s"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_failing" and SIGILL in err["message"] and "loading" not in err["message"]
    assert abs(int(r.headers["retry-after"]) - left) <= 3, (r.headers["retry-after"], left)
    listed = {x["id"]: x for x in httpx.get(cp.gateway + "/v1/models", timeout=10).json()["data"]}
    assert listed["m"]["llmgw"]["status"] == "failing" and SIGILL in listed["m"]["llmgw"]["reason"]
    assert listed["s"]["llmgw"]["status"] == "ready"

    # Temporal: the model's workflows are found by its search attribute, with model and profile in the memo.
    found = wait_until(lambda: asyncio.run(workflows(temporal.address, namespace, 'LlmgwModel = "m"')),
                       timeout_s=20, what="m's workflows by LlmgwModel")
    assert f"replica/{rep['id']}/start" in {wf.id for wf in found}
    start = next(wf for wf in found if wf.id == f"replica/{rep['id']}/start")
    assert asyncio.run(start.memo()) == {"model": "m", "profile": "default"}
    assert asyncio.run(workflows(temporal.address, namespace, 'LlmgwNode = "n1" AND LlmgwKind = "start"'))
    assert asyncio.run(workflows(temporal.address, namespace, 'LlmgwKind = "reconciler"'))
    assert asyncio.run(workflows(temporal.address, namespace, f'LlmgwReplica = "{rep["id"]}" AND LlmgwKind = "logs"'))

    # Control-plane metrics on the control worker and the agent.
    text = httpx.get(f"http://127.0.0.1:{control_port}/metrics", timeout=10).text
    assert metric(text, "llmgw_replica_starts_total", model="m", outcome="failed") >= 1
    assert metric(text, "llmgw_replica_starts_total", model="s", outcome="ready") == 1
    assert metric(text, "llmgw_replica_time_to_ready_seconds_count", model="s") == 1
    assert metric(text, "llmgw_model_failed_starts", model="m") >= 1
    assert metric(text, "llmgw_model_backoff_seconds", model="m") > 0
    assert metric(text, "llmgw_replicas", model="s", status="ready") == 1
    assert metric(text, "llmgw_reconcile_passes_total") >= 1
    assert metric(text, "llmgw_reconcile_pass_seconds_count") >= 1
    assert metric(text, "llmgw_reconcile_decisions_total", kind="place") >= 2
    agent = httpx.get(f"http://127.0.0.1:{agent_port}/metrics", timeout=10).text
    assert metric(agent, "llmgw_node_downloads_in_flight") == 0
    assert metric(agent, "llmgw_node_download_bytes") == 0

    # ctl retry clears the backoff: the next start comes at once (while `ctl replicas --watch` looks on).
    watcher = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "replicas", "--watch", "--interval", "0.5"],
                               env=cp.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = cp.ctl("retry", "m")
        assert out.returncode == 0 and re.match(r"m: cleared [1-9]\d* failed start\(s\) and \S+ of backoff", out.stdout), out
        again = wait_until(lambda: [r for r in cp.replicas() if r["model"] == "m" and r["id"] != rep["id"]],
                           timeout_s=20, what="a new start of m after ctl retry", why=cp.logs)
        wait_until(lambda: model_view(cp, "m")["status"] == "failing", timeout_s=60, what="m failing again")
        time.sleep(1.5)
    finally:
        watcher.send_signal(signal.SIGINT)
        try:
            stdout, stderr = watcher.communicate(timeout=15)
        finally:  # a watch that did not stop is not left running
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0 and "Traceback" not in stderr, stderr
    assert again[0]["id"][:8] in stdout and stdout.count("REPLICA") >= 2  # printed again as it changed
    after = model_view(cp, "m")
    assert after["restarts"] == 1  # counted afresh from the retry ...
    assert after["replaced"] == 2  # ... while RESTARTS only grows
    assert row(cp.ctl("models").stdout, "m").split()[3] == "2"


@pytest.fixture(scope="module")
def bare_temporal(tmp_path_factory):
    """A Temporal server without llmgw's search attributes registered (a deployment that skipped it)."""
    server = TemporalDevServer(free_port(), None, None, tmp_path_factory.mktemp("bare") / "temporal.log",
                               search_attributes={})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_workflows_start_without_registered_search_attributes(tmp_path, database_url, bare_temporal):
    """A namespace without the attributes: replicas still start, stop and show their logs; the worker
    says once what to register."""
    cp = ControlPlane(tmp_path, database_url, bare_temporal.address)
    try:
        cp.start()
        cp.agent("n1")
        cp.wait_nodes("n1")
        assert cp.apply({"models": catalog("unused")["models"][1:]}).status_code == 200
        [rep] = cp.wait_replicas("s", timeout_s=60)
        out = cp.ctl("logs", rep["id"][:8])
        assert out.returncode == 0 and not out.stderr, out.stderr
        worker = next(p for p in cp.procs if p.name == "worker").log()
        assert worker.count("lacks llmgw's search attributes") == 1, worker
        assert "temporal operator search-attribute create --namespace default --name LlmgwNode --type KeywordList" in worker
        assert cp.apply({"models": []}).status_code == 200  # a stop workflow, also without them
        wait_until(lambda: all(r["status"] == "stopped" for r in cp.replicas()), timeout_s=60, what="s stopped",
                   why=cp.logs)
    finally:
        cp.stop()


def test_an_engine_that_prints_its_key_never_has_it_shown_and_its_log_is_not_world_readable(control_plane, tmp_path):
    """SGLang logs its `server_args`, engine key included. That key is what the gateway sends to the engine;
    its log was 0644 (any local user could read it) and its last words went to the control plane as they
    were. Here an engine prints its key and exits: the failure `ctl replicas` shows says `<engine key>`,
    the key itself appears nowhere the admin API gives out, and the log is 0600 in a 0700 directory."""
    cp = control_plane
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    leaky = tmp_path / "llama-server"
    leaky.write_text(f"#!{sys.executable}\nimport os, sys\nprint('server_args: api_key=' + os.environ['LLAMA_API_KEY'])\n"
                     "sys.exit(2)\n")
    leaky.chmod(0o755)
    cp.env.update(LLMGW_START_BACKOFF_BASE_S="120")
    cp.start()
    cp.agent("n1", LLMGW_LLAMA_SERVER=str(leaky))
    cp.wait_nodes("n1")
    assert cp.apply({"models": [{"name": "m", "scaling": {"min": 1, "max": 1},
                                 "profiles": [{"engine": "llamacpp", "source": str(weights)}]}]}).status_code == 200
    failed = wait_until(lambda: next((r for r in cp.replicas() if r["model"] == "m" and r["status"] == "failed"), None),
                        timeout_s=60, what="m's replica failed", why=cp.logs)
    assert "server_args: api_key=<engine key>" in failed["failure"], failed["failure"]
    [log] = list((cp.state / "logs" / "n1").glob(f"{failed['id']}-r0.log"))
    key = log.read_text().split("api_key=")[1].split()[0]
    assert len(key) > 16 and key not in json.dumps(cp.replicas()), "the engine key reached the admin API"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700
