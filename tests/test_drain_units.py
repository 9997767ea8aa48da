"""`gateway/drain.py` on its own (the real-process test is tests/test_gateway_drain.py): what each kind of
open request gets when the drain runs out, and the setting's bounds."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from llmgw.config import Settings
from llmgw.gateway.drain import Drain


class Client:
    """What one request sent back, message by message."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def send(self, m: dict) -> None:
        self.messages.append(m)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    @property
    def ended(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.messages)


async def streaming(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    while True:
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        await asyncio.sleep(0.05)


async def short(scope, receive, send) -> None:
    await asyncio.sleep(0.1)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def waiting(scope, receive, send) -> None:
    await asyncio.sleep(3600)  # queued for a slot, or an engine that has not answered yet


async def test_the_drain_ends_each_kind_of_open_request_as_it_can_be_ended():
    drain = Drain(timeout_s=0.4)
    clients = {name: Client() for name in ("stream", "short", "waiting")}
    tasks = [asyncio.create_task(drain(fn, {}, None, clients[name].send))
             for name, fn in (("stream", streaming), ("short", short), ("waiting", waiting))]
    await asyncio.sleep(0.05)
    assert drain.state() == {"status": "ready", "open": 3}
    told = []
    drain.on_drain.append(lambda: told.append(True))
    ending = asyncio.create_task(drain.drain())
    await asyncio.sleep(0.01)
    assert told and drain.state()["status"] == "draining"
    late = Client()
    await drain(short, {}, None, late.send)  # a new request while draining: refused, the handler never runs
    assert late.status == 503 and json.loads(late.body)["error"]["code"] == "gateway_draining"
    start = next(m for m in late.messages if m["type"] == "http.response.start")
    assert (b"connection", b"close") in start["headers"] and (b"retry-after", b"1") in start["headers"]
    assert await ending == 2  # the stream and the waiting one; the short answer finished within the drain
    await asyncio.gather(*tasks)
    assert clients["short"].status == 200 and clients["short"].body == b"{}"
    stream = clients["stream"].body.decode()
    assert stream.endswith("data: [DONE]\n\n") and stream.count('"error"') == 1 and clients["stream"].ended
    assert '"code": "gateway_draining"' in stream.split("\n\n")[-3]
    assert clients["waiting"].status == 503 and clients["waiting"].ended
    assert drain.state()["open"] == 0


async def test_a_drain_with_nothing_open_returns_at_once():
    drain = Drain(timeout_s=30)
    assert await asyncio.wait_for(drain.drain(), 1) == 0


@pytest.mark.parametrize("value", ["-1", "3601", "soon", "nan"])
def test_the_drain_timeout_setting_is_bounded(monkeypatch, value):
    monkeypatch.setenv("LLMGW_GATEWAY_DRAIN_TIMEOUT_S", value)
    with pytest.raises(ValidationError, match="gateway_drain_timeout_s"):
        Settings()
