"""Anthropic's Messages API and OpenAI's Responses API as chat completions, and back (gateway/messages.py,
gateway/responses.py): the pure translations, and the API key from `x-api-key`. Through the real gateway:
tests/test_doors.py."""

from __future__ import annotations

import json

import pytest

from llmgw.gateway import messages as m
from llmgw.gateway import responses as r
from llmgw.http.errors import APIError
from llmgw.security.api_keys import api_token


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    obj = {"id": "c1", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for ev in raw.split(b"\n\n"):
        if not ev:
            continue
        lines = ev.split(b"\n")
        assert lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), ev
        out.append((lines[0][7:].decode(), json.loads(lines[1][6:])))
    return out


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


# ---- Messages: requests ----------------------------------------------------------------------------
def test_a_messages_request_becomes_a_chat_with_system_tools_and_tool_results_in_order():
    req = {"model": "x", "max_tokens": 50, "system": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "and kind"}],
           "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3, "metadata": {"user_id": "u1"},
           "tools": [{"name": "get", "description": "fetch", "input_schema": {"type": "object"}}],
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [
               {"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                 {"type": "text", "text": "calling"},
                                                 {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                             "content": [{"type": "text", "text": "boom"}]},
                                            {"type": "text", "text": "go on"}]}]}
    chat = m.to_chat(req)
    assert chat["max_tokens"] == 50 and chat["stop"] == ["END"] and chat["top_k"] == 3 and chat["user"] == "u1"
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"},
                                                               "description": "fetch"}}]
    assert chat["messages"] == [
        {"role": "system", "content": "be brief\n\nand kind"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
        {"role": "user", "content": "go on"}]
    assert "stream" not in chat
    streamed = m.to_chat({**req, "stream": True})
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


def test_an_image_block_becomes_an_image_url_part():
    chat = m.to_chat({"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert chat["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("body, param", [
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "x", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "x", "max_tokens": "5", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "x", "max_tokens": True, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "x", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "x", "max_tokens": 5, "messages": "hi"}, "messages"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
     "messages[0].content[0]"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nowhere", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}, "messages[0].content[0].type"),
    ({"model": "x", "max_tokens": 5, "system": 5, "messages": [{"role": "user", "content": "hi"}]}, "system"),
    ({"model": "x", "max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "hi"}]},
     "stop_sequences"),
    ({"model": "x", "max_tokens": 5, "stream": "yes", "messages": [{"role": "user", "content": "hi"}]}, "stream"),
    ({"model": "x", "max_tokens": 5, "temperature": "hot", "messages": [{"role": "user", "content": "hi"}]},
     "temperature"),
    ({"model": "x", "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
      "messages": [{"role": "user", "content": "hi"}]}, "tools[0].type"),
    ({"model": "x", "max_tokens": 5, "tools": [{"name": "t"}], "tool_choice": {"type": "sometimes"},
      "messages": [{"role": "user", "content": "hi"}]}, "tool_choice"),
])
def test_a_messages_request_off_its_shape_is_a_400_naming_the_field(body, param):
    assert refused(m.to_chat, body).param == param


def test_more_content_blocks_than_the_bound_is_a_400():
    blocks = [{"type": "text", "text": "a"}] * (m.MAX_BLOCKS + 1)
    err = refused(m.to_chat, {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": blocks}]})
    assert str(m.MAX_BLOCKS) in err.message


def test_count_tokens_takes_no_max_tokens():
    assert "max_tokens" not in m.to_chat({"model": "x", "messages": [{"role": "user", "content": "hi"}]}, count_only=True)


def test_a_body_that_is_no_object_is_a_400():
    for body in (b"[1]", b"not json", b'"text"'):
        refused(m.decode_request, body)


# ---- Messages: answers -----------------------------------------------------------------------------
def test_a_chat_answer_becomes_a_message_with_text_tool_use_and_usage():
    chat = {"id": "c9", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "sure", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 2}'}},
            {"id": "call_2", "type": "function", "function": {"name": "bad", "arguments": "not json"}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}}
    out = json.loads(m.answer(json.dumps(chat).encode(), "asked"))
    assert out["id"] == "msg_c9" and out["type"] == "message" and out["model"] == "asked"
    assert out["content"] == [{"type": "text", "text": "sure"},
                              {"type": "tool_use", "id": "call_1", "name": "get", "input": {"a": 2}},
                              {"type": "tool_use", "id": "call_2", "name": "bad", "input": {"_arguments": "not json"}}]
    assert out["stop_reason"] == "tool_use" and out["stop_sequence"] is None
    assert out["usage"] == {"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 2}


@pytest.mark.parametrize("finish, matched, reason, sequence", [
    ("stop", None, "end_turn", None), ("length", None, "max_tokens", None), ("stop", "END", "stop_sequence", "END"),
    ("content_filter", None, "refusal", None), (None, None, "end_turn", None)])
def test_stop_reasons(finish, matched, reason, sequence):
    chat = {"choices": [{"finish_reason": finish, "stop_reason": matched, "message": {"content": "x"}}]}
    out = json.loads(m.answer(json.dumps(chat).encode(), "x", ["END"]))
    assert (out["stop_reason"], out["stop_sequence"]) == (reason, sequence)


def test_an_answer_that_is_no_chat_completion_is_a_502():
    for data in (b"{}", b'{"choices": []}', b"[1]", b'{"choices": [{"message": 5}]}'):
        with pytest.raises(APIError) as info:
            m.answer(data, "x")
        assert info.value.status == 502


def test_errors_in_anthropics_envelope():
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"),
                         (500, "api_error"), (502, "api_error"), (503, "overloaded_error")):
        body = json.loads(m.error_body(APIError(status, "why", code="c")))
        assert body == {"type": "error", "error": {"type": kind, "message": "why", "code": "c"}}


# ---- Messages: streams -----------------------------------------------------------------------------
def test_a_chat_stream_becomes_anthropics_event_sequence():
    s = m.MessagesStream("asked")
    raw = s.feed(chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hel"}))
    raw += s.feed(chunk({"content": "lo"}))
    raw += s.feed(chunk({"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "get", "arguments": '{"a"'}}]}))
    raw += s.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"))
    raw += s.feed(USAGE + DONE)
    assert s.feed(chunk({"content": "after"})) == b""
    ev = events(raw)
    assert [k for k, _ in ev] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert all(k == obj["type"] for k, obj in ev)
    assert ev[0][1]["message"]["model"] == "asked" and ev[0][1]["message"]["id"] == "msg_c1"
    assert ev[3][1]["delta"] == {"type": "text_delta", "text": "Hel"} and ev[3][1]["index"] == 0
    assert ev[6][1]["content_block"] == {"type": "tool_use", "id": "t1", "name": "get", "input": {}}
    assert ev[8][1]["delta"] == {"type": "input_json_delta", "partial_json": ": 1}"} and ev[8][1]["index"] == 1
    assert ev[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ev[10][1]["usage"] == {"input_tokens": 5, "output_tokens": 3}


def test_an_error_event_ends_an_anthropic_stream_with_an_error_event():
    s = m.MessagesStream("x")
    raw = s.feed(chunk({"content": "part"}))
    raw += s.feed(b'data: {"error": {"message": "the engine failed: gone", "type": "upstream_error"}}\n\n' + DONE)
    ev = events(raw)
    assert ev[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "the engine failed: gone",
                                                           "code": None}})
    assert "message_stop" not in [k for k, _ in ev]


def test_unknown_chunks_are_skipped_and_a_stream_of_nothing_still_ends_well():
    s = m.MessagesStream("x")
    raw = s.feed(b'data: {"type": "weird"}\n\ndata: not json\n\ndata: {"choices": [{"delta": {"mystery": 1}}]}\n\n')
    raw += s.feed(DONE)
    assert [k for k, _ in events(raw)] == ["message_start", "ping", "message_delta", "message_stop"]


def test_a_gateway_error_before_the_stream_began_is_one_error_event():
    ev = events(m.MessagesStream("x").error(APIError(503, "loading failed", code="model_failing")))
    assert ev == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "loading failed",
                                                         "code": "model_failing"}})]


# ---- Responses ---------------------------------------------------------------------------------------
def test_a_responses_request_becomes_a_chat():
    chat = r.to_chat({"model": "x", "instructions": "be brief", "max_output_tokens": 9, "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}, "store": True})
    assert chat["max_tokens"] == 9 and chat["tool_choice"] == "required"
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert [x["role"] for x in chat["messages"]] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert chat["messages"][2]["content"] == "ab"
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]
    assert r.to_chat({"model": "x", "input": "hello"})["messages"] == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("body, param", [
    ({"model": "x", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "x", "input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"model": "x", "input": "hi", "background": True}, "background"),
    ({"model": "x"}, "input"),
    ({"model": "x", "input": []}, "input"),
    ({"model": "x", "input": 5}, "input"),
    ({"input": "hi"}, "model"),
    ({"model": "x", "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"model": "x", "input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"model": "x", "input": [{"type": "function_call_output", "call_id": "nowhere", "output": "x"}]},
     "input[0].call_id"),
    ({"model": "x", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"model": "x", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "x", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "x", "input": "hi", "stream": 1}, "stream"),
    ({"model": "x", "input": "hi", "instructions": ["a"]}, "instructions"),
])
def test_a_responses_request_off_its_shape_is_a_400_naming_the_field(body, param):
    err = refused(r.to_chat, body)
    assert err.param == param
    if param == "previous_response_id":
        assert "stores no responses" in err.message


def test_a_chat_answer_becomes_a_response():
    shape = r.Shape({"model": "asked", "instructions": "i", "metadata": {"k": "v"}})
    chat = {"choices": [{"finish_reason": "length", "message": {"content": "hi", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    out = json.loads(r.answer(json.dumps(chat).encode(), shape))
    assert out["object"] == "response" and out["id"].startswith("resp_") and out["model"] == "asked"
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["content"][0]["text"] == "hi" and out["output"][0]["role"] == "assistant"
    assert out["output"][1]["type"] == "function_call" and out["output"][1]["call_id"] == "call_1"
    assert out["usage"]["input_tokens"] == 3 and out["usage"]["total_tokens"] == 5
    assert out["instructions"] == "i" and out["metadata"] == {"k": "v"}


def test_a_chat_stream_becomes_responses_events_numbered_in_order():
    s = r.ResponsesStream(r.Shape({"model": "x"}))
    raw = s.feed(chunk({"content": "Hel"}) + chunk({"content": "lo"}))
    raw += s.feed(chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                        "tool_calls"))
    raw += s.feed(USAGE + DONE)
    ev = events(raw)
    assert [k for k, _ in ev] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [obj["sequence_number"] for _, obj in ev] == list(range(len(ev)))
    assert ev[6][1]["text"] == "Hello"
    done = ev[-1][1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 3
    assert [o["type"] for o in done["output"]] == ["message", "function_call"]
    assert done["output"][0]["content"][0]["text"] == "Hello" and "_text" not in done["output"][0]


def test_a_failed_responses_stream_ends_with_error_and_response_failed():
    s = r.ResponsesStream(r.Shape({"model": "x"}))
    raw = s.feed(chunk({"content": "a"}) + b'data: {"error": {"message": "gone", "code": "engine_error"}}\n\n' + DONE)
    ev = events(raw)
    assert [k for k, _ in ev][-2:] == ["error", "response.failed"]
    assert ev[-2][1]["message"] == "gone" and ev[-1][1]["response"]["status"] == "failed"


# ---- keys ----------------------------------------------------------------------------------------------
def test_the_api_key_comes_from_x_api_key_or_bearer_and_never_from_two_different_ones():
    assert api_token([(b"x-api-key", b"k1")]) == "k1"
    assert api_token([(b"authorization", b"Bearer k1")]) == "k1"
    assert api_token([(b"authorization", b"Bearer k1"), (b"x-api-key", b"k1")]) == "k1"
    assert api_token([(b"authorization", b"Bearer k1"), (b"x-api-key", b"k2")]) is None
    assert api_token([(b"x-api-key", b"k1"), (b"x-api-key", b"k1")]) is None
    assert api_token([(b"x-api-key", b"")]) is None
    assert api_token([]) is None


# ---- metrics ---------------------------------------------------------------------------------------------
def test_the_itl_histogram_renders_cumulative_buckets_and_goes_with_its_model():
    from llmgw.telemetry import GatewayMetrics

    metrics = GatewayMetrics()
    for gap in (0.001, 0.001, 0.03, 9.0):  # a gap on a bound counts in that bucket (`le`)
        metrics.itl_of("m").observe(gap)
    metrics.observe("m", 200, 1.0, 0.1)  # the model has series of its own, which `forget` knows by
    page = metrics.render().decode()
    assert 'llmgw_itl_seconds_bucket{le="0.001",model="m"} 2.0' in page
    assert 'llmgw_itl_seconds_bucket{le="0.04",model="m"} 3.0' in page
    assert 'llmgw_itl_seconds_bucket{le="+Inf",model="m"} 4.0' in page
    assert 'llmgw_itl_seconds_count{model="m"} 4.0' in page and 'llmgw_itl_seconds_sum{model="m"} 9.032' in page
    metrics.forget({"other"})
    assert 'model="m"' not in metrics.render().decode()
    metrics.tenant_ttft("t1", 0.2)
    assert 'llmgw_tenant_ttft_seconds_count{tenant="t1"} 1.0' in metrics.render_tenants().decode()
    assert "tenant_ttft" not in metrics.render().decode()
