"""The splice of a stream continued on another replica (gateway/resume.py), piece by piece: what a request
allows, what the relayed events say, the continuation's request and its events rewritten as the client's.
The real path (a sim engine SIGKILLed mid-stream) is tests/test_stream_resume.py."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmgw.gateway.resume import FOLD_BYTES, Splice, continues_chat, refusal
from llmgw.gateway.sse import SSEFrames
from llmgw.schemas.catalog import Model, Profile

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def chat_chunk(text: str | None, i: int = 0, rid: str = "chatcmpl-1", created: int = 100, finish=None,
               role: bool = False, **delta) -> bytes:
    d = {"role": "assistant"} if role else {}
    if text is not None:
        d["content"] = text
    d.update(delta)
    return event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m",
                  "choices": [{"index": i, "delta": d, "finish_reason": finish}]})


def req(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True, **kw}


# ---- what a request allows --------------------------------------------------------------------------
@pytest.mark.parametrize("body, why", [
    (req(n=2), "n > 1"), (req(best_of=3), "best_of"), (req(logprobs=True), "logprobs"),
    (req(top_logprobs=2), "logprobs"), (req(echo=True), "echo"),
    (req(response_format={"type": "json_object"}), "structured output"),
    (req(guided_json={"type": "object"}), "structured output"),
    (req(tools=[{"type": "function"}], tool_choice="required"), "a forced tool call"),
    (req(tools=[{"type": "function"}], tool_choice={"type": "function", "function": {"name": "f"}}),
     "a forced tool call"),
    (req(messages=[{"role": "user", "content": "x"}], continue_final_message=True), "a final message that is not text"),
])
def test_a_request_that_cannot_be_continued_says_why(body, why):
    assert refusal(CHAT, body) == why


def test_plain_requests_can_be_continued():
    assert refusal(CHAT, req()) is None
    assert refusal(CHAT, req(n=1, tools=[{"type": "function"}], tool_choice="auto",
                             response_format={"type": "text"})) is None
    assert refusal(COMPLETIONS, {"prompt": "abc"}) is None
    assert refusal(COMPLETIONS, {"prompt": ["abc"]}) is None
    assert refusal(COMPLETIONS, {"prompt": ["a", "b"]}) == "a prompt that is not one text"
    assert refusal(COMPLETIONS, {"prompt": [1, 2, 3]}) == "a prompt that is not one text"


def test_which_engines_continue_a_final_assistant_message():
    assert continues_chat(Profile(engine="vllm")) and continues_chat(Profile(engine="sglang"))
    assert continues_chat(Profile(engine="sim")) and continues_chat(Profile(engine="llamacpp"))
    assert not continues_chat(Profile(engine="llamacpp", args=["--no-prefill-assistant"]))
    assert not continues_chat(Profile(engine="llamacpp", env={"LLAMA_ARG_NO_PREFILL_ASSISTANT": "1"}))


# ---- the relayed events -----------------------------------------------------------------------------
def test_fold_reads_the_text_relayed_and_the_first_answers_id():
    s = Splice(CHAT, req(max_tokens=10), attempts=1)
    s.keep(chat_chunk("α ", role=True) + chat_chunk("β "))
    s.keep(chat_chunk("γ "))
    s.fold()
    assert "".join(s.text) == "α β γ " and s.events == 3
    assert (s.id, s.created) == ("chatcmpl-1", 100)
    assert s.why_not() is None and not s.finished


@pytest.mark.parametrize("chunk, why", [
    (chat_chunk(None, tool_calls=[{"index": 0, "function": {"name": "f"}}]), "tool calls streamed"),
    (chat_chunk(None, reasoning_content="hmm"), "reasoning streamed"),
    (chat_chunk("x", i=1), "several choices"),
    (event({"error": {"message": "boom"}}), "an error event"),
    (b"data: {not json\n\n", "an event that is not JSON"),
    # The events are parsed as one JSON array: a payload that reads as two values there, or that would
    # close the array early, is still one event that is not JSON.
    (b"data: 1,2\n\n", "an event that is not JSON"),
    (b"data: {}],[{}\n\n", "an event that is not JSON"),
    (b'data: {"choices": [{"index": 0, "delta": {"content": "\xff"}}]}\n\n', "an event that is not JSON"),
])
def test_what_was_streamed_can_block_a_continuation(chunk, why):
    s = Splice(CHAT, req(), attempts=1)
    s.keep(chat_chunk("α ") + chunk)
    s.fold()
    assert s.why_not() == why


def test_an_event_of_several_data_lines_and_the_events_after_a_bad_one_are_read():
    s = Splice(CHAT, req(), attempts=1)
    s.keep(b'data: {"id": "chatcmpl-9", "choices":\ndata: [{"index": 0, "delta": {"content": "a"}}]}\n\n')
    s.keep(b"data: {oops\n\n" + chat_chunk("b"))
    s.fold()
    assert "".join(s.text) == "ab" and s.id == "chatcmpl-9" and s.why_not() == "an event that is not JSON"


def test_a_finish_reason_or_usage_relayed_means_the_answer_is_whole():
    s = Splice(CHAT, req(), attempts=1)
    s.keep(chat_chunk("α ", finish="stop"))
    s.fold()
    assert s.finished
    s = Splice(CHAT, req(), attempts=1)
    s.keep(chat_chunk("α ") + event({"id": "x", "choices": [], "usage": {"prompt_tokens": 1}}))
    s.fold()
    assert s.finished


def test_attempts_used_block_it():
    s = Splice(CHAT, req(), attempts=0)
    assert s.why_not() == "its attempts are used"


def test_a_long_stream_is_folded_as_it_goes_holding_little_unparsed():
    s = Splice(CHAT, req(), attempts=1)
    one = chat_chunk("α ")
    for _ in range(FOLD_BYTES // len(one) + 10):
        s.keep(one)
    assert s.raw_bytes <= FOLD_BYTES and s.events > 0  # folded once past the bound
    s.fold()
    assert s.events == FOLD_BYTES // len(one) + 10 and s.raw == []


# ---- the continuation's request ------------------------------------------------------------------------
def test_a_chat_continuation_sends_the_text_as_a_final_assistant_message_with_the_cap_lowered():
    s = Splice(CHAT, req(max_tokens=10, temperature=0.2), attempts=1)
    s.keep(chat_chunk("α ", role=True) + chat_chunk("β ") + chat_chunk("", finish=None))
    s.fold()
    body = s.request()
    assert body["messages"] == [{"role": "user", "content": "go"}, {"role": "assistant", "content": "α β "}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["temperature"] == 0.2 and body["stream"] is True
    assert s.prefix_tokens == 2


def test_a_client_prefill_is_extended_not_repeated():
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Sure: "}]
    s = Splice(CHAT, req(messages=messages, continue_final_message=True, add_generation_prompt=False), attempts=1)
    s.keep(chat_chunk("α "))
    s.fold()
    assert s.request()["messages"][-1] == {"role": "assistant", "content": "Sure: α "}


def test_a_completion_continuation_appends_the_text_to_the_prompt():
    s = Splice(COMPLETIONS, {"model": "m", "prompt": "once", "max_tokens": 5, "stream": True}, attempts=1)
    s.keep(event({"id": "cmpl-1", "created": 5, "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}))
    s.fold()
    body = s.request()
    assert body["prompt"] == "once upon" and body["max_tokens"] == 4 and "continue_final_message" not in body
    s = Splice(COMPLETIONS, {"model": "m", "prompt": ["once"], "n_predict": 3}, attempts=1)
    s.keep(event({"id": "cmpl-1", "choices": [{"index": 0, "text": " a"}]}))
    s.fold()
    assert s.request() == {"model": "m", "prompt": ["once a"], "n_predict": 2}


def test_nothing_relayed_asks_the_same_request_again():
    s = Splice(CHAT, req(max_tokens=4), attempts=1)
    s.fold()
    assert s.request() == req(max_tokens=4)


def test_a_cap_already_reached_asks_nothing():
    s = Splice(CHAT, req(max_tokens=2), attempts=1)
    s.keep(chat_chunk("α ") + chat_chunk("β "))
    s.fold()
    assert s.request() is None


# ---- the continuation's events --------------------------------------------------------------------------
def test_the_continuations_events_become_the_first_answers():
    s = Splice(CHAT, req(max_tokens=4, stream_options={"include_usage": True}), attempts=1)
    s.keep(chat_chunk("α ", role=True) + chat_chunk("β "))
    s.fold()
    s.request()
    s.legs = 2
    # The continuation: its own id and created, an opening role, then text, finish, usage (its prompt held
    # the user's 1 word and the 2 of the prefix).
    cont = (chat_chunk("", rid="chatcmpl-2", created=200, role=True) + chat_chunk("γ ", rid="chatcmpl-2", created=200)
            + chat_chunk("δ ", rid="chatcmpl-2", created=200, finish="length")
            + event({"id": "chatcmpl-2", "created": 200, "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            + b"data: [DONE]\n\n")
    frames = SSEFrames()
    out = s.rewrite(frames.feed(cont))
    events = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e.startswith("data: {")]
    assert [e["id"] for e in events] == ["chatcmpl-1"] * 3 and {e["created"] for e in events} == {100}
    assert [c["delta"] for e in events[:2] for c in e["choices"]] == [{"content": "γ "}, {"content": "δ "}]
    assert events[2]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert out.endswith(b"data: [DONE]\n\n")


def test_error_events_and_comments_pass_untouched():
    s = Splice(CHAT, req(), attempts=1)
    s.id = "chatcmpl-1"
    err = event({"error": {"message": "x"}})
    assert s.rewrite(b": ping\n\n" + err) == b": ping\n\n" + err


def test_a_third_leg_counts_the_whole_prefix():
    s = Splice(COMPLETIONS, {"prompt": "p", "max_tokens": 6}, attempts=2)
    s.keep(event({"id": "a", "created": 1, "choices": [{"index": 0, "text": "x"}]}))
    s.fold()
    assert s.request()["max_tokens"] == 5
    s.legs = 2
    s.keep(s.rewrite(event({"id": "b", "created": 2, "choices": [{"index": 0, "text": "y"}]})))
    s.fold()
    body = s.request()
    assert body["prompt"] == "pxy" and body["max_tokens"] == 4
    out = s.rewrite(event({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}))
    assert json.loads(out[6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert json.loads(out[6:])["id"] == "a"


# ---- the catalog setting ----------------------------------------------------------------------------------
def test_stream_resume_is_on_by_default_with_one_attempt():
    m = Model.model_validate({"name": "m", "profiles": [{"engine": "sim"}]})
    assert (m.stream_resume.attempts, m.stream_resume.stall_s) == (1, 30.0)
    assert "routing" not in m.model_dump(mode="json")  # unset: not written (older versions refuse it)
    m = Model.model_validate({"name": "m", "profiles": [{"engine": "sim"}],
                              "routing": {"stream_resume": {"attempts": 0, "stall_s": "2m"}}})
    assert (m.stream_resume.attempts, m.stream_resume.stall_s) == (0, 120.0)


@pytest.mark.parametrize("routing, field", [
    ({"stream_resume": {"attempts": 4}}, "attempts"), ({"stream_resume": {"attempts": -1}}, "attempts"),
    ({"stream_resume": {"attempts": "many"}}, "attempts"), ({"stream_resume": {"attempts": True}}, "attempts"),
    ({"stream_resume": {"stall_s": 0}}, "stall_s"), ({"stream_resume": {"stall_s": -5}}, "stall_s"),
    ({"stream_resume": {"stall_s": "soon"}}, "stall_s"), ({"stream_resume": {"stall_s": 1e300}}, "stall_s"),
    ({"stream_resume": {"stal_s": 3}}, "stal_s"), ({"resume": {}}, "resume"), ({"stream_resume": []}, "stream_resume"),
])
def test_abusive_settings_are_refused_naming_the_field(routing, field):
    with pytest.raises(ValidationError) as e:
        Model.model_validate({"name": "m", "profiles": [{"engine": "sim"}], "routing": routing})
    assert field in str(e.value)
