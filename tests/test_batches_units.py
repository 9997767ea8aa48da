"""Files and batches (issue 41) without processes: the batch file's line rules, the batch token, who owns
what, and `BatchWorkflow` on a real Temporal worker with stand-in activities (rounds until the batch ends,
continue-as-new, the finish). The real path: tests/test_batches.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from llmgw.control.batch_activities import _usage
from llmgw.control.worker import workflow_runner
from llmgw.gateway.batches import batch_identity, owner_of
from llmgw.schemas.batches import (
    BatchInput, FinishBatchInput, FinishBatchResult, LineErrors, RunBatchInput, RunBatchResult, parse_lines,
)
from llmgw.security.batch_token import batch_secret, batch_token, verify
from llmgw.workflows import batch as batch_module
from llmgw.workflows.batch import BatchWorkflow
from llmgw.workflows.ids import batch_workflow_id
from llmgw.workflows.queues import CONTROL_QUEUE

CHAT = "/v1/chat/completions"


def line(cid: str = "a", url: str = CHAT, **body) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode()


def test_good_lines_are_read_in_order_skipping_empty_ones():
    out = parse_lines(line("a") + b"\n\n" + line("b") + b"\n", CHAT, 10)
    assert [(x.line, x.custom_id) for x in out] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize("bad, says", [
    (b"{nope", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'"text"', "not a JSON object"),
    (line("") , "`custom_id`"),
    (line("x" * 513), "`custom_id`"),
    (json.dumps({"custom_id": 5, "method": "POST", "url": CHAT, "body": {"model": "m"}}).encode(), "`custom_id`"),
    (line("b", url="/v1/embeddings"), "`url`"),
    (json.dumps({"custom_id": "b", "method": "GET", "url": CHAT, "body": {"model": "m"}}).encode(), "`method`"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": CHAT, "body": [1]}).encode(), "`body`"),
    (line("b", messages=[]), "`body.model`"),
    (line("b", model="m", stream=True), "`body.stream`"),
    (line("a"), "unique"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
])
def test_a_bad_line_is_named_with_its_number(bad: bytes, says: str):
    with pytest.raises(LineErrors) as e:
        parse_lines(line("a") + b"\n" + bad + b"\n", CHAT, 10)
    assert e.value.errors[0][0] == 2 and says in e.value.errors[0][1], e.value.errors


def test_only_the_first_bad_lines_are_named_and_all_are_counted():
    with pytest.raises(LineErrors) as e:
        parse_lines(b"\n".join([b"{"] * 40), CHAT, 100)
    assert e.value.count == 40 and len(e.value.errors) == 5 and "(and 35 more)" in str(e.value)


def test_too_many_lines_and_none_are_refused():
    with pytest.raises(LineErrors, match="more than 3 requests"):
        parse_lines(b"\n".join(line(str(i)) for i in range(4)), CHAT, 3)
    with pytest.raises(LineErrors, match="no requests"):
        parse_lines(b"\n \n", CHAT, 3)


def test_a_batch_token_names_one_batch_and_key():
    secret = batch_secret(None, "postgresql://u:pw@h/db")
    token = batch_token(secret, "batch_1", "k1")
    assert verify(secret, token) == ("batch_1", "k1")
    assert verify(secret, token.replace("batch_1", "batch_2")) is None
    assert verify(secret, token.replace(".k1.", ".k2.")) is None
    assert verify(batch_secret(None, "postgresql://u:other@h/db"), token) is None
    assert verify(None, token) is None and verify(secret, "sk-llmgw-abc") is None
    assert batch_secret(None, "postgresql://u@h/db") is None or os.environ.get("PGPASSWORD")
    headers = [(b"authorization", b"Bearer " + token.encode())]
    assert batch_identity(headers, secret) == ("batch_1", "k1")
    assert batch_identity([(b"authorization", b"Bearer " + token[:-1].encode() + b"0")], secret) is False
    assert batch_identity([(b"authorization", b"Bearer sk-other")], secret) is None


def test_owners():
    assert owner_of(None) == ("-", "", "")
    assert owner_of(("k1", "team")) == ("tenant:team", "k1", "team")
    assert owner_of(("k1", None)) == ("key:k1", "k1", "")


def test_usage_of_each_endpoint():
    assert _usage({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert _usage({"usage": {"prompt_tokens": 3}}) == (3, 0)  # embeddings
    assert _usage({"usage": {"input_tokens": 5, "output_tokens": 6}}) == (5, 6)  # Responses
    assert _usage({"usage": {"prompt_tokens": -1, "completion_tokens": "7"}}) == (0, 0)
    assert _usage({}) == (0, 0)


class StandIns:
    """`run_batch_requests` answers `rounds` rounds, the last one ended with `reason`."""

    def __init__(self, rounds: int, reason: str = "completed"):
        self.rounds = rounds
        self.reason = reason
        self.calls = 0
        self.finished: list[FinishBatchInput] = []

    @activity.defn(name="run_batch_requests")
    async def run_batch_requests(self, inp: RunBatchInput) -> RunBatchResult:
        self.calls += 1
        ended = self.calls >= self.rounds
        return RunBatchResult(ended=ended, reason=self.reason if ended else "", answered=3)

    @activity.defn(name="finish_batch")
    async def finish_batch(self, inp: FinishBatchInput) -> FinishBatchResult:
        self.finished.append(inp)
        return FinishBatchResult(status=inp.reason, completed=3 * self.calls)


async def run_batch(temporal, namespace: str, acts: StandIns, batch_id: str):
    client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
    queue = CONTROL_QUEUE  # (the workflow's activities go there; the namespace is this test's own)
    async with Worker(client, task_queue=queue, workflows=[BatchWorkflow],
                      activities=[acts.run_batch_requests, acts.finish_batch], workflow_runner=workflow_runner()):
        handle = await client.start_workflow(BatchWorkflow.run, BatchInput(batch_id=batch_id),
                                             id=batch_workflow_id(batch_id), task_queue=queue)
        return handle, await handle.result()


@pytest.mark.integration
async def test_the_workflow_runs_rounds_then_finishes_with_their_reason(temporal, namespace):
    """Rounds until one ends the batch; continue-as-new after ROUNDS_PER_RUN rounds; the finish gets the
    reason (here `expired`). With LLMGW_HISTORIES_OUT set, both runs' histories are written there for
    tests/test_replay.py (tests/histories/v7)."""
    rounds = batch_module.ROUNDS_PER_RUN + 1
    acts = StandIns(rounds=rounds, reason="expired")
    handle, result = await run_batch(temporal, namespace, acts, "batch_units")
    assert acts.calls == rounds and [f.reason for f in acts.finished] == ["expired"]
    assert result.status == "expired" and result.completed == 3 * rounds
    wid = batch_workflow_id("batch_units")
    runs = [w.run_id async for w in handle._client.list_workflows(f'WorkflowId="{wid}"')]
    assert len(runs) == 2  # one continue-as-new
    out = os.environ.get("LLMGW_HISTORIES_OUT")
    for run_id in runs if out else ():
        history = await handle._client.get_workflow_handle(wid, run_id=run_id).fetch_history()
        (Path(out) / f"batch--{wid.replace('/', '_')}--{run_id[:8]}.json").write_text(history.to_json())
