"""Temporal keeps no signed URL in the clear (issue 36): with a payload key beside the CA (`llmgw ctl cert
payload-key`), every process of a real fleet (gateway, control worker, agent) encrypts what it gives Temporal
and reads what it gets. A catalog source that is a signed URL is loaded on demand and served; the histories
of every workflow hold neither its token nor any plain payload; the admin API's codec endpoint, used by the
real Temporal CLI (`temporal workflow show --codec-endpoint`), shows them to the operator."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import aiohttp
import httpx
import pytest
from temporalio.client import Client

from llmgw.dev.temporal_server import temporal_binary
from llmgw.security.payload_codec import ENCODING
from tests.test_gateway_on_demand import SIGNED, WeightServer, apply, body

pytestmark = pytest.mark.integration


CLEAR = {".activity_task_scheduled_event_attributes.header.fields", ".marker_recorded_event_attributes.details.payloads",
         ".upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields",
         ".workflow_execution_started_event_attributes.search_attributes.indexed_fields"}


def payloads(event) -> list:
    """Every Payload inside a history event, wherever it is nested (inputs, results, heartbeats, signals), with
    the name of the field it is in."""
    found = []

    def walk(msg, where=""):
        for field, value in msg.ListFields():
            if field.type != field.TYPE_MESSAGE:
                continue
            items = value.values() if field.message_type.GetOptions().map_entry else (
                value if field.is_repeated else [value])
            for item in items:
                if item.DESCRIPTOR.full_name == "temporal.api.common.v1.Payload":
                    found.append((where + "." + field.name, item))
                else:
                    walk(item, where + "." + field.name)
    walk(event)
    return found


def shown_data(out: str) -> bytes:
    """The payload bytes in `temporal workflow show --output json` (base64 in its JSON), joined."""
    found: list[bytes] = []

    def walk(v):
        if isinstance(v, dict):
            if isinstance(v.get("data"), str) and "metadata" in v:
                found.append(base64.b64decode(v["data"]))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    try:
        walk(json.loads(out))
    except ValueError:
        return b""
    return b"\0".join(found)


async def test_a_fleet_with_a_payload_key_serves_and_temporal_keeps_only_ciphertext(control_plane, temporal, namespace):
    cp = control_plane
    made = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "cert", "payload-key", "--dir", str(cp.pki)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    cp.env["LLMGW_LOAD_WAIT_S"] = "30"
    weights = await WeightServer().start()
    try:
        await asyncio.to_thread(cp.start)
        cp.agent("node-a")
        await asyncio.to_thread(cp.wait_nodes, "node-a")
        await apply(cp, {"models": [{"name": "enc", "scaling": {"min": 0, "max": 1, "idle_timeout": 600},
                                     "profiles": [{"engine": "sim", "source": weights.url + SIGNED,
                                                   "args": ["--tokens-per-second", "0"]}]}]})
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.gateway + "/v1/chat/completions", json=body("enc")) as r:
                assert r.status == 200, await r.text()
    finally:
        await weights.close()

    raw = await Client.connect(temporal.address, namespace=namespace)  # no key: what Temporal's readers see
    ids = [w.id async for w in raw.list_workflows()]
    assert any(i.startswith("replica/") for i in ids), ids
    encrypted, plain = 0, set()
    for wid in ids:
        history = await raw.get_workflow_handle(wid).fetch_history()
        for event in history.events:
            assert b"SECRET-SIG" not in event.SerializeToString(), (wid, event)
            for where, p in payloads(event):
                if p.metadata.get("encoding") == ENCODING:
                    encrypted += 1
                elif p.data:
                    plain.add(where)
    # Plain only where Temporal itself must read them: search attributes (indexed), headers (the node-activity
    # origin token, checked by the node, no secret), the SDK's patch markers (a patch id).
    assert encrypted > 10 and plain <= CLEAR, (encrypted, sorted(plain - CLEAR))

    # The operator's view: the Temporal CLI decodes through the admin API (the token required).
    replica = next(i for i in ids if i.startswith("replica/"))
    show = [temporal_binary(), "workflow", "show", "--address", temporal.address, "--namespace", namespace,
            "--workflow-id", replica, "--codec-endpoint", cp.admin + "/admin/v1/codec", "--output", "json"]
    shown = subprocess.run(show + ["--codec-auth", cp.admin_headers["authorization"]], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and b"SECRET-SIG" in shown_data(shown.stdout), shown.stderr[-2000:]
    refused = subprocess.run(show, capture_output=True, text=True, timeout=60)
    assert b"SECRET-SIG" not in shown_data(refused.stdout)
    for content, says in ((b'{"payloads": 5}', "Payloads"), (b"not json", "Payloads"), (b"\xff\xfe", "Payloads"),
                          (b'{"payloads": [{"metadata": {"encoding": "YmluYXJ5L2VuY3J5cHRlZA=="}, "data": "AAAA"}]}',
                           "does not hold")):
        bad = httpx.post(cp.admin + "/admin/v1/codec/decode", content=content,
                         headers={**cp.admin_headers, "content-type": "application/json"}, timeout=10)
        assert bad.status_code == 400 and says in bad.json()["error"]["message"], (content, bad.text)
    many = httpx.post(cp.admin + "/admin/v1/codec/decode", json={"payloads": [{"data": ""}] * 1001},
                      headers=cp.admin_headers, timeout=10)
    assert many.status_code == 400 and "at most 1000" in many.json()["error"]["message"], many.text
