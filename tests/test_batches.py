"""OpenAI's Files and Batch APIs through the real gateway (issue 41), with the official `openai` client,
unmodified: a real `llmgw server` and `llmgw worker` (each batch a `BatchWorkflow` on Temporal) in front of
a real sim engine. One control plane for the module. The line rules themselves: tests/test_batches_units.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import psycopg
import pytest

from llmgw.dev.procs import stop_process, wait_port
from llmgw.security.batch_token import batch_secret, batch_token
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import Sim, create_key, create_tenant, usage_rows

pytestmark = pytest.mark.integration

MAX_FILE_BYTES = 256 << 10  # the module's batch_max_file_bytes: a file over it is cheap to send


@pytest.fixture(scope="module")
async def plane(tmp_path_factory, module_database_url, temporal):
    """The control plane; `.alpha` and `.beta` keys of two tenants, `.sim` the sim engine."""
    sim = Sim("sim")
    slow = Sim("slow", tokens_per_second=40)  # a request of 16 tokens takes about 0.4 s (models slow, narrow, four)
    namespace = temporal.free_namespaces.pop(0)
    cp = ControlPlane(tmp_path_factory.mktemp("batches"), module_database_url, temporal.address,
                      LLMGW_TEMPORAL_NAMESPACE=namespace, LLMGW_ROUTE_REFRESH_S="0.5",
                      LLMGW_BATCH_MAX_FILE_BYTES=str(MAX_FILE_BYTES), LLMGW_BATCH_MAX_LINES="1000",
                      LLMGW_BATCH_PARALLEL="16")
    cp.env["LLMGW_BATCH_GATEWAY_URL"] = cp.gateway
    try:
        for s in (sim, slow):
            wait_port(s.port, 30, s.proc, "sim engine")
        await asyncio.to_thread(cp.start)
        r = cp.apply({"models": [{"name": "sim", "endpoints": [sim.url]}, {"name": "slow", "endpoints": [slow.url]},
                                 {"name": "narrow", "endpoints": [slow.url],
                                  "limits": {"max_concurrency": 1, "max_queue": 10}},
                                 # 4 at a time: a batch of it runs for seconds, so a test can act mid-run
                                 {"name": "four", "endpoints": [slow.url],
                                  "limits": {"max_concurrency": 4, "max_queue": 64}}]})
        assert r.status_code == 200, r.text
        create_tenant(cp, "alpha")
        create_tenant(cp, "beta")
        cp.alpha = create_key(cp, "alpha-1", "alpha")  # type: ignore[attr-defined]
        cp.beta = create_key(cp, "beta-1", "beta")  # type: ignore[attr-defined]
        cp.db = module_database_url  # type: ignore[attr-defined]
        cp.sim, cp.slow = sim, slow  # type: ignore[attr-defined]
        for key in (cp.alpha, cp.beta):  # type: ignore[attr-defined]
            await asyncio.to_thread(wait_until, lambda key=key: "slow" in httpx.get(
                cp.gateway + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10).text,
                timeout_s=20, what="the gateway knowing the catalog and the keys")
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        for s in (sim, slow):
            stop_process(s.proc)


def client(cp: ControlPlane, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cp.gateway + "/v1", api_key=key, max_retries=0)


def jsonl(n: int, model: str = "sim", prefix: str = "r") -> bytes:
    return "".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": 16,
                                        "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n"
                   for i in range(n)).encode()


async def finished(gpt: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        b = await gpt.batches.retrieve(batch_id)
        if b.status in ("completed", "expired", "cancelled", "failed"):
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}: {b.request_counts}"
        await asyncio.sleep(0.3)


def output_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def batch_rows(cp: ControlPlane, batch_id: str) -> int:
    with psycopg.connect(cp.db) as conn:  # type: ignore[attr-defined]
        return conn.execute("SELECT count(*) FROM batch_results WHERE batch_id = %s", (batch_id,)).fetchone()[0]


def tenant_usage(cp: ControlPlane, tenant: str, model: str) -> tuple[int, int, int]:
    rows = [r for r in usage_rows(cp, tenant) if r[1] == model]
    return (sum(r[2] for r in rows), sum(r[3] for r in rows), sum(r[4] for r in rows))


async def test_a_batch_of_200_requests_completes_with_200_output_lines(plane):
    """files.create, batches.create, retrieve and files.content with the official client: 200 answers, each
    custom_id once, the counts and timestamps OpenAI's object has, and the tenant's usage counted once."""
    gpt = client(plane, plane.alpha)
    before = tenant_usage(plane, "alpha", "sim")
    f = await gpt.files.create(file=("requests.jsonl", jsonl(200)), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(200))
    assert (await gpt.files.retrieve(f.id)).id == f.id
    assert (await gpt.files.content(f.id)).content == jsonl(200)
    batch = await gpt.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 200
    assert batch.expires_at - batch.created_at == 24 * 3600
    done = await finished(gpt, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 200 and done.request_counts.failed == 0
    assert done.completed_at and done.finalizing_at and done.in_progress_at and done.error_file_id is None
    assert done.metadata == {"job": "nightly"}
    lines = output_lines((await gpt.files.content(done.output_file_id)).text)
    assert len(lines) == 200
    assert sorted(ln["custom_id"] for ln in lines) == sorted(f"r-{i}" for i in range(200))
    assert all(ln["response"]["status_code"] == 200 and ln["error"] is None for ln in lines)
    assert all(ln["response"]["body"]["choices"][0]["message"]["content"] for ln in lines)
    prompt = sum(ln["response"]["body"]["usage"]["prompt_tokens"] for ln in lines)
    completion = sum(ln["response"]["body"]["usage"]["completion_tokens"] for ln in lines)
    after = tenant_usage(plane, "alpha", "sim")
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (200, prompt, completion)
    listed = await gpt.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    files = await gpt.files.list()
    assert {f.id, done.output_file_id} <= {x.id for x in files.data}


async def test_bad_lines_are_refused_naming_them(plane):
    """A line that is not JSON, a duplicate custom_id and a wrong url: 400 naming each line; no batch."""
    gpt = client(plane, plane.alpha)
    good = jsonl(3).splitlines()
    bad = b"\n".join([good[0], b"{not json", good[0], good[1].replace(b"/v1/chat/completions", b"/v1/embeddings"),
                      good[2]]) + b"\n"
    f = await gpt.files.create(file=("bad.jsonl", bad), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        await gpt.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    msg = e.value.body["message"]  # type: ignore[index]
    assert "3 bad lines" in msg and "line 2: not JSON" in msg and "line 3:" in msg and "unique" in msg
    assert "line 4:" in msg and "`url`" in msg
    for field, value in (("endpoint", "/v1/images"), ("completion_window", "1h")):
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", field: value}
        with pytest.raises(openai.BadRequestError) as e:
            await gpt.batches.create(**args)
        assert e.value.body["param"] == field  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        await gpt.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await gpt.batches.list(limit=1000)


async def test_a_file_over_the_limit_is_refused_before_it_is_read(plane):
    """413 from the client's Content-Length; a chunked upload is cut off once it passes the limit."""
    gpt = client(plane, plane.alpha)
    with pytest.raises(openai.APIStatusError) as e:
        await gpt.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES * 2)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # the module's batch_max_lines is 1000
        await gpt.files.create(file=("many.jsonl", b"{}\n" * 1001), purpose="batch")
    assert e.value.body["param"] == "file" and "at most 1000 lines" in e.value.body["message"]  # type: ignore[index]

    def chunks():
        for _ in range(64):
            yield b"y" * (16 << 10)  # 1 MiB in all, 4x the limit
    r = httpx.post(plane.gateway + "/v1/files", content=chunks(), timeout=30,
                   headers={"authorization": f"Bearer {plane.alpha}",
                            "content-type": "multipart/form-data; boundary=zz"})
    assert r.status_code == 413, r.text


async def test_another_tenants_file_and_batch_are_not_found(plane):
    """Beta never reads alpha's file or batch, nor makes a batch of alpha's file: 404, as for none."""
    alpha, beta = client(plane, plane.alpha), client(plane, plane.beta)
    f = await alpha.files.create(file=("mine.jsonl", jsonl(2, prefix="own")), purpose="batch")
    batch = await alpha.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: beta.files.retrieve(f.id), lambda: beta.files.content(f.id), lambda: beta.files.delete(f.id),
                 lambda: beta.batches.retrieve(batch.id), lambda: beta.batches.cancel(batch.id),
                 lambda: beta.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert f.id not in [x.id for x in (await beta.files.list()).data]
    assert batch.id not in [x.id for x in (await beta.batches.list()).data]
    await finished(alpha, batch.id)
    assert (await alpha.files.delete(f.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await alpha.files.retrieve(f.id)


async def test_a_cancelled_batch_keeps_what_it_finished(plane):
    """Cancel mid-run: `cancelled`, the answered requests in the output file, the rest in the error file
    as `batch_cancelled`; every line in exactly one of them."""
    gpt = client(plane, plane.alpha)
    f = await gpt.files.create(file=("slow.jsonl", jsonl(80, model="four", prefix="c")), purpose="batch")
    batch = await gpt.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await asyncio.to_thread(wait_until, lambda: batch_rows(plane, batch.id) >= 8, timeout_s=30,
                            what="some answers")
    cancelling = await gpt.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await finished(gpt, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    out = output_lines((await gpt.files.content(done.output_file_id)).text)
    err = output_lines((await gpt.files.content(done.error_file_id)).text)
    assert 8 <= len(out) < 80 and len(out) + len(err) == 80
    assert {ln["error"]["code"] for ln in err} == {"batch_cancelled"}
    assert sorted(ln["custom_id"] for ln in out + err) == sorted(f"c-{i}" for i in range(80))


async def test_a_batch_request_waits_behind_interactive_ones(plane):
    """On a saturated model (one slot) a batch's request that queued first is served after an interactive
    request that queued later: the batch band. A batch token that does not verify is a 401."""
    token = batch_token(batch_secret(None, plane.db), "batch_probe", "")
    done: list[str] = []

    async def post(http: httpx.AsyncClient, name: str, auth: str, tokens: int) -> None:
        r = await http.post(plane.gateway + "/v1/chat/completions", headers={"authorization": f"Bearer {auth}"},
                            json={"model": "narrow", "max_tokens": tokens, "messages": [{"role": "user", "content": name}]})
        assert r.status_code == 200, r.text
        done.append(name)

    async with httpx.AsyncClient(timeout=30) as http:
        holder = asyncio.create_task(post(http, "holder", plane.alpha, 40))  # about 1 s on its slot
        await asyncio.sleep(0.3)
        batch = asyncio.create_task(post(http, "batch", token, 4))
        await asyncio.sleep(0.3)
        later = asyncio.create_task(post(http, "interactive", plane.alpha, 4))
        await asyncio.gather(holder, batch, later)
        assert done == ["holder", "interactive", "batch"], done
        r = await http.post(plane.gateway + "/v1/chat/completions", headers={"authorization": f"Bearer {token}x"},
                            json={"model": "narrow", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401


async def test_a_batch_survives_its_worker_and_gateway_killed(plane):
    """SIGKILL the control worker and the gateway mid-batch, then start them again: every request answered
    exactly once (one output line and one committed answer each), and the tenant's usage counted once:
    exactly the requests and tokens of the output file, however many the engine served twice."""
    gpt = client(plane, plane.beta)
    before = tenant_usage(plane, "beta", "four")
    served_before = plane.slow.counters().get("sim:requests_total", 0)
    f = await gpt.files.create(file=("faults.jsonl", jsonl(60, model="four", prefix="k")), purpose="batch")
    batch = await gpt.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await asyncio.to_thread(wait_until, lambda: batch_rows(plane, batch.id) >= 10, timeout_s=30,
                            what="the first answers")
    for name in ("worker", "server"):
        proc = next(p for p in reversed(plane.procs) if p.name == name and p.alive())
        proc.kill()
    assert batch_rows(plane, batch.id) < 60
    server = plane.spawn("server", "server")
    plane.spawn("worker", "worker")
    wait_port(plane.ports["gateway"], 60, server.proc, "gateway")
    done = await finished(gpt, batch.id, timeout_s=90)
    assert done.status == "completed" and done.request_counts.completed == 60, done
    lines = output_lines((await gpt.files.content(done.output_file_id)).text)
    assert sorted(ln["custom_id"] for ln in lines) == sorted(f"k-{i}" for i in range(60))
    assert batch_rows(plane, batch.id) == 60
    prompt = sum(ln["response"]["body"]["usage"]["prompt_tokens"] for ln in lines)
    completion = sum(ln["response"]["body"]["usage"]["completion_tokens"] for ln in lines)
    after = tenant_usage(plane, "beta", "four")
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (60, prompt, completion)
    served = plane.slow.counters().get("sim:requests_total", 0) - served_before
    assert served >= 60  # (more when a request in flight at the kill was sent again: it is not billed twice)
