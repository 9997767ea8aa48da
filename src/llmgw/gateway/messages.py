"""Anthropic's Messages API (`POST /v1/messages`) as chat completions, and back: pure functions.

The gateway serves a Messages request by translating it into a chat completion (`to_chat`), sending that
through the one request pipeline every chat takes (gateway/proxy.py: keys, tenants, budgets with
`max_tokens` as the reservation, guard, fallbacks, holding through a load, usage, fair queues), and
translating the answer back: a whole one with `answer`, a stream event by event with `MessagesStream`.
Errors are written in Anthropic's envelope (`error_body`): `{"type": "error", "error": {"type", "message"}}`.

Translated, with what Anthropic's API requires checked here (a 400 naming the field):
- `model`, `max_tokens` (required, 1..2^31-1), `messages` (user/assistant turns), `system` (a string or
  text blocks), `stop_sequences` (-> `stop`), `temperature`, `top_p`, `top_k`, `stream`, `metadata.user_id`
  (-> `user`), `tools` (-> function tools), `tool_choice` (auto, any -> required, tool, none);
- content blocks: `text`, `image` (base64 or URL source, -> an `image_url` part, which the gateway's media
  rules then judge), `tool_use` in an assistant turn (-> its `tool_calls`), `tool_result` in a user turn
  (-> a `tool` message; one that answers no earlier `tool_use` is refused), `thinking` and
  `redacted_thinking` (dropped: engines take no signed thinking back);
- any other block type is refused, naming it; `cache_control` and unknown top-level fields are ignored.
At most `MAX_BLOCKS` content blocks in one request.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

from llmgw.gateway.openai_api import model_refusal
from llmgw.http import errors
from llmgw.http.errors import APIError
from llmgw.http.jsonbody import JSONRefused, decode

MAX_BLOCKS = 4096  # content blocks (and string messages) in one request, system blocks included
MAX_TOKENS = (1 << 31) - 1
MAX_STOP = 16  # stop sequences (engines look for each at every token)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}


class Door(Protocol):
    """One request of another API at the gateway's door, as gateway/proxy.py serves it: `request` (the body)
    -> the chat completion request to serve, or a 400 `APIError`; `error_body` an error in the API's
    envelope; `answer` a whole chat answer in the API's form (502 when it is none); `stream()` the
    translator of a chat stream (`feed(events) -> bytes`, `error(err) -> bytes`)."""

    path: str

    def request(self, body: bytes) -> dict: ...

    def error_body(self, err: APIError) -> bytes: ...

    def answer(self, data: bytes) -> bytes: ...

    def stream(self) -> Any: ...


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(err: APIError) -> bytes:
    """`err` in Anthropic's envelope (the gateway's own `code` kept beside, which Anthropic clients ignore)."""
    return json.dumps({"type": "error", "error": {"type": error_type(err.status), "message": err.message,
                                                   "code": err.code}}).encode()


def _bad(message: str, param: str) -> APIError:
    return errors.bad_request(message, param=param)


def decode_request(body: bytes) -> dict:
    """The request body as a JSON object, bounded as every body is (http/jsonbody.py), or a 400."""
    try:
        req = decode(body)
    except JSONRefused as exc:
        raise errors.bad_request(str(exc), param=exc.param) from None
    except ValueError:
        raise errors.bad_request("the request body must be a JSON object") from None
    if not isinstance(req, dict):
        raise errors.bad_request("the request body must be a JSON object ({\"model\": ..., \"messages\": [...]})")
    return req


def _text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"`{where}.text` must be a string", f"{where}.text")
    return text


def _image(block: dict, where: str) -> dict:
    src = block.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str) \
            and isinstance(src.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{src['media_type']};base64,{src['data']}"}}
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise _bad(f"`{where}.source` must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
               "{\"type\": \"url\", \"url\"}", f"{where}.source")


def _result_text(content: Any, where: str) -> str | list:
    """A tool_result's `content`: a string, or text (and image) blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"`{where}.content` must be a string or a list of text blocks", f"{where}.content")
    parts = []
    for k, b in enumerate(content):
        w = f"{where}.content[{k}]"
        if not isinstance(b, dict) or b.get("type") not in ("text", "image"):
            raise _bad(f"`{w}` must be a text or image block", w)
        parts.append({"type": "text", "text": _text(b, w)} if b["type"] == "text" else _image(b, w))
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


class _Count:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def add(self, n: int) -> None:
        self.n += n
        if self.n > MAX_BLOCKS:
            raise _bad(f"the request holds more than {MAX_BLOCKS} content blocks; send fewer (or join adjacent "
                       "text blocks)", "messages")


def _turns(messages: Any, count: _Count) -> list[dict]:
    """Anthropic's `messages` as chat messages."""
    if not isinstance(messages, list) or not messages:
        raise _bad("`messages` is required: a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\"}",
                   "messages")
    out: list[dict] = []
    called: set[str] = set()  # tool_use ids said so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"`{where}.role` must be \"user\" or \"assistant\"", f"{where}.role")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            count.add(1)
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"`{where}.content` must be a string or a list of content blocks", f"{where}.content")
        count.add(len(content))
        parts: list[dict] = []
        calls: list[dict] = []
        results: list[dict] = []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if not isinstance(kind, str):
                raise _bad(f"`{w}` must be an object with a `type` (\"text\", \"image\", \"tool_use\", "
                           "\"tool_result\")", w)
            if kind == "text":
                parts.append({"type": "text", "text": _text(b, w)})
            elif kind == "image":
                parts.append(_image(b, w))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not b["id"]:
                    raise _bad(f"`{w}` must have a string `id` and `name`", w)
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise _bad(f"`{w}.input` must be an object", f"{w}.input")
                called.add(b["id"])
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(args)}})
            elif kind == "tool_result" and role == "user":
                ref = b.get("tool_use_id")
                if not isinstance(ref, str) or ref not in called:
                    raise _bad(f"`{w}.tool_use_id` must name a `tool_use` block of an earlier assistant turn "
                               f"({ref!r} names none)", f"{w}.tool_use_id")
                text = _result_text(b.get("content"), w)
                if b.get("is_error") is True and isinstance(text, str):
                    text = "Error: " + text
                results.append({"role": "tool", "tool_call_id": ref, "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise _bad(f"`{w}.type` {kind[:64]!r} is not supported in a {role} turn here; supported: text, "
                           "image, tool_use (assistant), tool_result (user), thinking (assistant, dropped)",
                           f"{w}.type")
        out.extend(results)  # a tool's answer follows the call it answers, before the rest of the turn
        if role == "assistant":
            if parts or calls:
                msg: dict = {"role": "assistant", "content": _joined(parts) if parts else None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        elif parts or not results:
            out.append({"role": "user", "content": _joined(parts)})
    return out


def _joined(parts: list[dict]) -> str | list[dict]:
    """Text-only content as one string (every engine's chat template reads that); with media, the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _system(system: Any, count: _Count) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _bad("`system` must be a string or a list of text blocks", "system")
    count.add(len(system))
    texts = []
    for i, b in enumerate(system):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _bad(f"`system[{i}]` must be a text block ({{\"type\": \"text\", \"text\": ...}})", f"system[{i}]")
        texts.append(_text(b, f"system[{i}]"))
    return "\n\n".join(texts)


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"`tools[{i}]` must be an object with a string `name`", f"tools[{i}]")
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, bash, ...) run there
            raise _bad(f"`tools[{i}].type` {str(t['type'])[:64]!r} is a server tool; only client tools (with "
                       "`input_schema`) are served here", f"tools[{i}].type")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad(f"`tools[{i}].input_schema` must be a JSON schema object", f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\"}",
               "tool_choice")


def _number(req: dict, field: str) -> None:
    v = req.get(field)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise _bad(f"`{field}` must be a number", field)


def to_chat(req: dict, count_only: bool = False) -> dict:
    """A decoded Messages request as a chat completion request, or a 400 `APIError` naming the field.
    `count_only`: for /v1/messages/count_tokens, which takes no `max_tokens`."""
    model = req.get("model")
    if (why := model_refusal(model)) is not None:
        raise _bad(why, "model")
    count = _Count()
    system = _system(req.get("system"), count)
    messages = _turns(req.get("messages"), count)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    out: dict = {"model": model, "messages": messages}
    if req.get("tools"):
        out["tools"] = _tools(req["tools"])
    if req.get("tool_choice") is not None and "tools" in out:
        choice = _tool_choice(req["tool_choice"])
        out["tool_choice"] = choice
        if req["tool_choice"].get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    if count_only:
        return out
    cap = req.get("max_tokens")
    if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_TOKENS:
        raise _bad("`max_tokens` is required: an integer from 1 (the most tokens the answer may have)", "max_tokens")
    out["max_tokens"] = cap
    stops = req.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise _bad(f"`stop_sequences` must be a list of at most {MAX_STOP} non-empty strings", "stop_sequences")
        if stops:
            out["stop"] = stops
    for field in ("temperature", "top_p", "top_k"):
        _number(req, field)
        if req.get(field) is not None:
            out[field] = req[field]
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("`stream` must be true or false", "stream")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # message_delta carries the counts
    meta = req.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        out["user"] = meta["user_id"]
    return out


def message_id(chat_id: Any) -> str:
    return "msg_" + (chat_id if isinstance(chat_id, str) and chat_id.isascii() and len(chat_id) < 128
                     else uuid.uuid4().hex)


def _input(arguments: Any) -> dict:
    """A tool call's JSON arguments as the object Anthropic's `input` is; text that is no JSON object is
    kept under `_arguments` rather than lost."""
    if isinstance(arguments, dict):
        return arguments
    try:
        obj = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except ValueError:
        obj = None
    return obj if isinstance(obj, dict) else {"_arguments": arguments}


def _stop(choice: dict, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice. vLLM says which stop string ended it (`stop_reason`)."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def _usage(usage: Any) -> dict:
    u = usage if isinstance(usage, dict) else {}
    out = {"input_tokens": _int(u.get("prompt_tokens")), "output_tokens": _int(u.get("completion_tokens"))}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") if isinstance(u.get("prompt_tokens_details"), dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool):
        out["cache_read_input_tokens"] = cached
    return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def answer(data: bytes, model: str, stops: list[str] | None = None) -> bytes:
    """A whole chat completion answer as a Messages answer; 502 when it is not one."""
    try:
        chat = json.loads(data)
        choice = chat["choices"][0]
        msg = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise errors.upstream_failed("its answer is not a chat completion") from None
    if not isinstance(msg, dict):
        raise errors.upstream_failed("its answer is not a chat completion")
    content: list[dict] = []
    if isinstance(msg.get("content"), str) and msg["content"]:
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            content.append({"type": "tool_use", "id": str(call.get("id") or "toolu_" + uuid.uuid4().hex),
                            "name": str(fn.get("name", "")), "input": _input(fn.get("arguments"))})
    reason, sequence = _stop(choice, stops)
    return json.dumps({"id": message_id(chat.get("id")), "type": "message", "role": "assistant", "model": model,
                       "content": content, "stop_reason": reason, "stop_sequence": sequence,
                       "usage": _usage(chat.get("usage"))}).encode()


def sse(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"


def chat_events(out: bytes):
    """The JSON objects (or the string "[DONE]") of complete chat SSE events, as gateway/sse.py relays them;
    events that are not JSON objects are skipped."""
    for event in out.split(b"\n\n"):
        data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data:
            continue
        if data == b"[DONE]":
            yield "[DONE]"
            continue
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            yield obj


class MessagesStream:
    """A chat completion stream, as the relay hands it on (complete events, then `[DONE]`; an error event
    before it when the engine failed), as Anthropic's event sequence: `message_start`, `ping`, for each
    content block `content_block_start`, `content_block_delta`s and `content_block_stop`, then
    `message_delta` (stop reason, usage) and `message_stop`; or an `error` event when the stream failed.
    Chunks of no known shape (no choices, no usage, no error) are skipped."""

    def __init__(self, model: str, stops: list[str] | None = None):
        self.native = False  # the engine serving it speaks Messages: its events pass as they are
        self.model = model
        self.stops = stops
        self.started = False
        self.ended = False
        self.index = -1  # the open block's index; -1: none
        self.kind: str | None = None  # "text" or the open tool call's chat index
        self.reason: tuple[str, str | None] = ("end_turn", None)
        self.usage: dict = {"input_tokens": 0, "output_tokens": 0}

    def feed(self, out: bytes) -> bytes:
        if self.native:
            return out
        if self.ended or not out:
            return b""
        parts: list[bytes] = []
        for obj in chat_events(out):
            if obj == "[DONE]":
                parts.append(self._end())
                break
            if isinstance(obj.get("error"), dict) or obj.get("type") == "error":
                parts.append(self._error(obj))
                break
            self._chunk(obj, parts)
        return b"".join(parts)

    def _start(self, parts: list[bytes], chat_id: Any) -> None:
        self.started = True
        parts.append(sse("message_start", {"type": "message_start", "message": {
            "id": message_id(chat_id), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": dict(self.usage)}}))
        parts.append(sse("ping", {"type": "ping"}))

    def _open(self, parts: list[bytes], kind: Any, block: dict) -> None:
        self._close(parts)
        self.index += 1
        self.kind = kind
        parts.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))

    def _close(self, parts: list[bytes]) -> None:
        if self.kind is not None:
            parts.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.kind = None

    def _delta(self, parts: list[bytes], delta: dict) -> None:
        parts.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))

    def _chunk(self, obj: dict, parts: list[bytes]) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        choices = obj.get("choices")
        if not self.started and (choices or "usage" in obj):
            self._start(parts, obj.get("id"))
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.kind != "text":
                self._open(parts, "text", {"type": "text", "text": ""})
            self._delta(parts, {"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            key = ("tool", call.get("index", 0))
            if self.kind != key or call.get("id"):
                self._open(parts, key, {"type": "tool_use", "id": str(call.get("id") or "toolu_" + uuid.uuid4().hex),
                                        "name": str(fn.get("name") or ""), "input": {}})
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                self._delta(parts, {"type": "input_json_delta", "partial_json": args})
        if choice.get("finish_reason"):
            self.reason = _stop(choice, self.stops)

    def _end(self) -> bytes:
        parts: list[bytes] = []
        if not self.started:
            self._start(parts, None)
        self._close(parts)
        self.ended = True
        reason, sequence = self.reason
        parts.append(sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                              "stop_sequence": sequence},
                                           "usage": self.usage}))
        parts.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(parts)

    def _error(self, obj: dict) -> bytes:
        self.ended = True
        err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        message = err.get("message") if isinstance(err.get("message"), str) else "the engine failed"
        kind = "overloaded_error" if err.get("type") == "service_unavailable" else "api_error"
        return sse("error", {"type": "error", "error": {"type": kind, "message": message, "code": err.get("code")}})

    def error(self, err: APIError) -> bytes:
        """The stream's end when the gateway fails it (held through a load that failed, a judged answer refused)."""
        if self.ended:
            return b""
        self.ended = True
        return sse("error", {"type": "error", "error": {"type": error_type(err.status), "message": err.message,
                                                        "code": err.code}})


class MessagesDoor:
    """One Messages request at the gateway's door (gateway/proxy.py calls it): the chat request it becomes,
    its answer and stream in Anthropic's form, its errors in Anthropic's envelope. Where the replica that
    serves it speaks Messages itself (gateway/dialects.py), the proxy sends it `original` instead
    (gateway/messages_native.py) and calls `passing(True)`: its answer and events then pass as they are.
    `may_pass`: the proxy allows it (not when the model's guard judges answers, which it reads as chats)."""

    path = "/v1/messages"

    def __init__(self) -> None:
        self.model = ""
        self.stops: list[str] | None = None
        self.original: dict = {}
        self.may_pass = False
        self.native = False
        self._stream: MessagesStream | None = None

    def request(self, body: bytes) -> dict:
        self.original = decode_request(body)
        chat = to_chat(self.original)
        self.model = chat["model"]
        self.stops = chat.get("stop")
        return chat

    error_body = staticmethod(error_body)

    def passing(self, native: bool) -> None:
        """The replica now asked speaks Messages (True) or takes the translation (False)."""
        self.native = native
        if self._stream is not None:
            self._stream.native = native

    def answer(self, data: bytes) -> bytes:
        if self.native:
            return data
        return answer(data, self.model, self.stops)

    def stream(self) -> MessagesStream:
        self._stream = MessagesStream(self.model, self.stops)
        return self._stream
