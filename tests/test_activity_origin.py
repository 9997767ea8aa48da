"""Node activities carry proof of origin (security/activity_origin.py, control/origin.py, node/origin.py).

The unit half: every way a token can fail to prove an activity is refused with its reason. The integration
half, on the session's Temporal dev server: the real signing interceptor on a workflow worker and the real
checking interceptor on a node worker; an honest workflow's activity runs, and an attacker's workflow on a
queue of its own (no header, a header copied out of the honest history, one for another node, an expired
one, one signed with another key) never reaches the activity's code, fails at once (non-retryable) and is
counted.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Interceptor, StartActivityInput, WorkflowInboundInterceptor, WorkflowOutboundInterceptor, Worker

from llmgw.control.origin import OriginSigning, origin_payload
from llmgw.control.worker import workflow_runner
from llmgw.node.origin import OriginCheck
from llmgw.schemas.payloads import StopShardInput, StopShardResult
from llmgw.security.activity_origin import (
    HEADER, OriginRefused, Signer, Verifier, create_signing_key, load_private_key, load_public_keys,
)

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)


def _pair(tmp_path: Path) -> tuple[Signer, Verifier]:
    key, pub = create_signing_key(tmp_path)
    return Signer(load_private_key(key), ttl_s=300), Verifier(load_public_keys(pub))


def _check(verifier: Verifier, token: str | None, **over):
    kw = dict(activity="stop_shard", queue="node/n1", workflow_id="wf", run_id="run",
              scheduled=NOW + timedelta(seconds=1), args=[StopShardInput(shard_id="r1-s0")])
    kw.update(over)
    return verifier.check(token, **kw)


def _reason(fn) -> str:
    with pytest.raises(OriginRefused) as exc:
        fn()
    return exc.value.reason


def test_a_token_proves_exactly_one_activity_on_one_node_in_one_run_with_one_input(tmp_path):
    signer, verifier = _pair(tmp_path)
    token = signer.token("stop_shard", "node/n1", "wf", "run", NOW, [StopShardInput(shard_id="r1-s0")])
    assert _check(verifier, token).args  # the honest case passes
    assert _reason(lambda: _check(verifier, None)) == "unsigned"
    assert _reason(lambda: _check(verifier, "")) == "unsigned"
    assert _reason(lambda: _check(verifier, "garbage")) == "malformed"
    assert _reason(lambda: _check(verifier, token + "x")) == "forged"
    assert _reason(lambda: _check(verifier, token, queue="node/n2")) == "other_node"
    assert _reason(lambda: _check(verifier, token, activity="launch_shard")) == "other_activity"
    assert _reason(lambda: _check(verifier, token, workflow_id="attacker")) == "other_workflow"
    assert _reason(lambda: _check(verifier, token, run_id="other-run")) == "other_workflow"
    assert _reason(lambda: _check(verifier, token, scheduled=NOW + timedelta(seconds=301))) == "expired"
    assert _reason(lambda: _check(verifier, token, args=[StopShardInput(shard_id="r2-s0")])) == "other_input"
    assert _reason(lambda: _check(verifier, token, args=[])) == "other_input"
    other = Signer(Ed25519PrivateKey.generate())
    forged = other.token("stop_shard", "node/n1", "wf", "run", NOW, [StopShardInput(shard_id="r1-s0")])
    assert _reason(lambda: _check(verifier, forged)) == "forged"
    # claims edited under the old signature: forged, whatever they say
    body, sig = token.split(".")
    assert _reason(lambda: _check(verifier, body[:-2] + "AA." + sig)) == "forged"


def test_an_activity_retried_long_after_its_token_expired_still_runs_because_it_was_scheduled_in_time(tmp_path):
    """The expiry bounds when the activity was first scheduled (a time the server sets), not when an attempt
    runs: a stop retried for days while its node was away is honest."""
    signer, verifier = _pair(tmp_path)
    token = signer.token("stop_shard", "node/n1", "wf", "run", NOW, [StopShardInput(shard_id="r1-s0")])
    assert _check(verifier, token, scheduled=NOW + timedelta(seconds=299))


def test_a_node_with_older_payload_types_verifies_a_newer_control_plane_s_token(tmp_path):
    """The node reads the signed copy with its own types, so fields it does not know are dropped from both."""
    class Newer(BaseModel):
        shard_id: str
        added_later: int = 7

    class Older(BaseModel):
        shard_id: str

    signer, verifier = _pair(tmp_path)
    token = signer.token("stop_shard", "node/n1", "wf", "run", NOW, [Newer(shard_id="a")])
    assert _check(verifier, token, args=[Older(shard_id="a")])
    assert _reason(lambda: _check(verifier, token, args=[Older(shard_id="b")])) == "other_input"


def test_a_node_trusts_every_key_in_its_file_while_keys_rotate(tmp_path):
    old_signer, _ = _pair(tmp_path / "old")
    new_signer, _ = _pair(tmp_path / "new")
    both = tmp_path / "both.pub"
    both.write_bytes((tmp_path / "old" / "activity-signing.pub").read_bytes()
                     + (tmp_path / "new" / "activity-signing.pub").read_bytes())
    verifier = Verifier(load_public_keys(both))
    for s in (old_signer, new_signer):
        assert _check(verifier, s.token("stop_shard", "node/n1", "wf", "run", NOW, [StopShardInput(shard_id="r1-s0")]))


def test_the_signing_key_is_private_and_kept(tmp_path):
    key, pub = create_signing_key(tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600
    before = key.read_bytes()
    assert create_signing_key(tmp_path) == (key, pub) and key.read_bytes() == before


# ---- on a real Temporal server ------------------------------------------------------------------------

class Node:
    """A node's `stop_shard`, which must run only for proven callers."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    @activity.defn(name="stop_shard")
    async def stop_shard(self, inp: StopShardInput) -> StopShardResult:
        self.ran.append(inp.shard_id)
        return StopShardResult(shard_id=inp.shard_id, was_running=True)


@workflow.defn(name="StopOne", sandboxed=False)
class StopOne:
    @workflow.run
    async def run(self, node_queue: str, shard_id: str) -> str:
        res = await workflow.execute_activity(
            "stop_shard", StopShardInput(shard_id=shard_id), result_type=StopShardResult, task_queue=node_queue,
            start_to_close_timeout=timedelta(seconds=10), retry_policy=RetryPolicy(maximum_attempts=3))
        return res.shard_id


class Inject(Interceptor):
    """The attacker's worker: puts a header of its choosing on every activity (or none)."""

    def __init__(self) -> None:
        self.header = None  # a callable (workflow info, input) -> token, or None for no header

    def workflow_interceptor_class(self, input):
        outer = self

        class Out(WorkflowOutboundInterceptor):
            def start_activity(self, input: StartActivityInput):
                if outer.header is not None:
                    input.headers = {**input.headers, HEADER: origin_payload(outer.header(workflow.info(), input))}
                return super().start_activity(input)

        class In(WorkflowInboundInterceptor):
            def init(self, outbound):
                super().init(Out(outbound))

        return In


async def _client(temporal, namespace) -> Client:
    return await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)


@pytest.mark.integration
async def test_only_a_workflow_of_the_signing_worker_commands_a_node(temporal, namespace, tmp_path):
    signer, verifier = _pair(tmp_path)
    client = await _client(temporal, namespace)
    node, refused = Node(), []
    queue = "node/n1"
    inject = Inject()
    async with Worker(client, task_queue=queue, activities=[node.stop_shard],
                      interceptors=[OriginCheck(verifier, "n1", lambda a, r: refused.append((a, r)))]), \
            Worker(client, task_queue="llmgw-control-test", workflows=[StopOne], workflow_runner=workflow_runner(),
                   interceptors=[OriginSigning(signer)]), \
            Worker(client, task_queue="attacker", workflows=[StopOne], interceptors=[inject]):
        honest_id = f"honest-{uuid.uuid4()}"
        assert await client.execute_workflow(StopOne.run, args=[queue, "r1-s0"], id=honest_id,
                                             task_queue="llmgw-control-test") == "r1-s0"
        assert node.ran == ["r1-s0"]

        # the honest token, as anyone with Temporal access reads it out of the history
        copied = None
        async for event in client.get_workflow_handle(honest_id).fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                copied = event.activity_task_scheduled_event_attributes.header.fields[HEADER].data.decode()
        assert copied

        other_key = Signer(Ed25519PrivateKey.generate())
        attacks = {
            "unsigned": None,
            "other_workflow": lambda info, inp: copied,
            "other_node": lambda info, inp: signer.token("stop_shard", "node/n2", info.workflow_id, info.run_id,
                                                         workflow.now(), inp.args),
            "expired": lambda info, inp: signer.token("stop_shard", inp.task_queue, info.workflow_id, info.run_id,
                                                      workflow.now() - timedelta(hours=1), inp.args),
            "forged": lambda info, inp: other_key.token("stop_shard", inp.task_queue, info.workflow_id, info.run_id,
                                                        workflow.now(), inp.args),
            "other_input": lambda info, inp: signer.token("stop_shard", inp.task_queue, info.workflow_id,
                                                          info.run_id, workflow.now(),
                                                          [StopShardInput(shard_id="harmless")]),
        }
        for reason, header in attacks.items():
            inject.header = header
            refused.clear()
            with pytest.raises(WorkflowFailureError) as exc:
                await asyncio.wait_for(client.execute_workflow(
                    StopOne.run, args=[queue, "r1-s0"], id=f"attack-{reason}-{uuid.uuid4()}", task_queue="attacker"),
                    30)
            cause = exc.value.cause.cause  # ActivityError -> ApplicationError
            assert cause.type == "OriginRefused" and cause.non_retryable, (reason, cause)
            assert refused == [("stop_shard", reason)], reason  # refused once: not retried
        assert node.ran == ["r1-s0"]  # the activity's code never ran for an attacker


# ---- through the real processes -------------------------------------------------------------------------

ONE = {"models": [{"name": "one", "scaling": {"min": 1, "max": 1},
                   "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]}]}


@pytest.mark.integration
async def test_a_stop_shard_from_outside_the_control_plane_leaves_the_engine_running(control_plane, namespace):
    """The issue's case: from any host that reaches Temporal, a workflow on a queue of its own calls
    `stop_shard` on a real node's queue with the real shard id. Unsigned, with a token copied out of the
    replica's own start history, one for another node, an expired one: the engine keeps its pid and serves,
    and the node logs and counts each refusal."""
    import httpx
    import psutil

    from llmgw.dev.procs import free_port
    from llmgw.workflows.ids import replica_start_id, shard_id
    from tests.helpers import wait_until

    cp = control_plane.start()
    metrics_port = free_port()
    agent = cp.agent("n1", LLMGW_AGENT_METRICS_PORT=str(metrics_port))
    assert cp.apply(ONE).status_code == 200
    [rep] = cp.wait_replicas("one", timeout_s=60)
    target = shard_id(rep["id"], 0)
    pid = cp.shard_pid("n1", target)
    signer = Signer(load_private_key(cp.pki / "activity-signing.key"))  # the control plane's own key

    client = await Client.connect(cp.env["LLMGW_TEMPORAL_ADDRESS"], namespace=namespace,
                                  data_converter=pydantic_data_converter)
    copied = None
    async for event in client.get_workflow_handle(replica_start_id(rep["id"])).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.task_queue.name == "node/n1":
                copied = attrs.header.fields[HEADER].data.decode()
    assert copied, "the control worker signs what it schedules on a node"

    inject = Inject()
    attacks = {
        "unsigned": None,
        "other_activity": lambda info, inp: copied,
        "other_node": lambda info, inp: signer.token("stop_shard", "node/n2", info.workflow_id, info.run_id,
                                                     workflow.now(), inp.args),
        "expired": lambda info, inp: signer.token("stop_shard", inp.task_queue, info.workflow_id, info.run_id,
                                                  workflow.now() - timedelta(hours=1), inp.args),
    }
    async with Worker(client, task_queue="attacker", workflows=[StopOne], interceptors=[inject]):
        for reason, header in attacks.items():
            inject.header = header
            with pytest.raises(WorkflowFailureError) as exc:
                await asyncio.wait_for(client.execute_workflow(
                    StopOne.run, args=["node/n1", target], id=f"attack-{reason}-{uuid.uuid4()}",
                    task_queue="attacker"), 30)
            assert exc.value.cause.cause.type == "OriginRefused", reason

    assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert cp.shard_pid("n1", target) == pid
    assert next(r for r in cp.replicas() if r["id"] == rep["id"])["status"] == "ready"
    body = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for reason in attacks:
        assert f'llmgw_node_activities_refused_total{{activity="stop_shard",reason="{reason}"}} 1.0' in text, text
    wait_until(lambda: agent.log().count("node n1 refused stop_shard") >= len(attacks), timeout_s=10,
               what="each refusal in the node's log")
