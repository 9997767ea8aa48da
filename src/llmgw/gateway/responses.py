"""OpenAI's Responses API (`POST /v1/responses`) as chat completions, and back: pure functions.

As gateway/messages.py does for Anthropic's API: `to_chat` makes the chat completion the gateway's one
request pipeline serves, `answer` and `ResponsesStream` make its answer a Response object or Responses
events. Errors keep OpenAI's envelope (the Responses API uses it too).

Translated: `model`, `input` (a string, or a list of items: messages with a role of user, assistant,
system or developer, whose content is a string or `input_text`/`output_text`/`input_image` parts;
`function_call` and `function_call_output` items; `reasoning` items, dropped), `instructions` (a system
message first), `max_output_tokens` (-> `max_tokens`, the budgets' reservation), `temperature`, `top_p`,
`tools` (function tools only), `tool_choice`, `parallel_tool_calls`, `text.format` (json_schema and
json_object, -> `response_format`), `user`, `metadata` (echoed), `stream`.

Refused with a 400 that says why: `previous_response_id` and `conversation` (the gateway stores no
response, so there is nothing to continue from: send the whole conversation as `input`), `background`,
tools other than functions (web search, file search, computer use, MCP: they run at OpenAI), a
`function_call_output` whose `call_id` names no earlier `function_call`. `store` is accepted and ignored:
nothing is stored, so `GET /v1/responses/{id}` is a 404.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from llmgw.gateway.openai_api import model_refusal
from llmgw.http import errors
from llmgw.http.errors import APIError
from llmgw.gateway.messages import MAX_BLOCKS, MAX_TOKENS, chat_events, decode_request

ROLES = ("user", "assistant", "system", "developer")


def _bad(message: str, param: str) -> APIError:
    return errors.bad_request(message, param=param)


def _part(p: Any, where: str) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(p.get("text"), str):
            raise _bad(f"`{where}.text` must be a string", f"{where}.text")
        return {"type": "text", "text": p["text"]}
    if kind == "input_image":
        url = p.get("image_url")
        if not isinstance(url, str):
            raise _bad(f"`{where}.image_url` must be a URL (a data: URL inline); `file_id` is not served here",
                       f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "refusal" and isinstance(p.get("refusal"), str):
        return {"type": "text", "text": p["refusal"]}
    raise _bad(f"`{where}.type` must be input_text, output_text or input_image", f"{where}.type")


def _content(content: Any, where: str, count: list[int]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"`{where}` must be a string or a list of content parts", where)
    count[0] += len(content)
    if count[0] > MAX_BLOCKS:
        raise _bad(f"`input` holds more than {MAX_BLOCKS} items and content parts; send fewer", "input")
    parts = [_part(p, f"{where}[{k}]") for k, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _items(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("`input` is required: a string, or a non-empty list of input items", "input")
    if len(items) > MAX_BLOCKS:
        raise _bad(f"`input` holds {len(items):,} items; at most {MAX_BLOCKS} go in one request", "input")
    out: list[dict] = []
    calls: set[str] = set()
    count = [0]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"`{where}` must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"`{where}.role` must be one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), f"{where}.content", count)})
        elif kind == "function_call":
            cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(cid, str) or not cid or not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"`{where}` must have a string `call_id`, `name` and `arguments`", where)
            calls.add(cid)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str) or cid not in calls:
                raise _bad(f"`{where}.call_id` must name a `function_call` item earlier in `input` ({cid!r} names "
                           "none; the gateway keeps no earlier response to find it in)", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": output if isinstance(output, str) else _content(output, f"{where}.output", count)})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"`{where}.type` {str(kind)[:64]!r} is not supported here; supported: message, "
                       "function_call, function_call_output, reasoning (dropped)", f"{where}.type")
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"`tools[{i}].type` {str(kind)[:64]!r}: only function tools are served here (built-in tools "
                       "run at OpenAI)", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"`tools[{i}].name` must be a string", f"tools[{i}].name")
        fn: dict = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\"}",
               "tool_choice")


def _format(text: Any) -> dict | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {"name": str(fmt.get("name") or "answer"), "schema": fmt["schema"]}
        if isinstance(fmt.get("strict"), bool):
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("`text.format` must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
               "{\"type\": \"json_schema\", \"name\", \"schema\"}", "text.format")


def to_chat(req: dict) -> dict:
    """A decoded Responses request as a chat completion request, or a 400 `APIError` naming the field."""
    model = req.get("model")
    if (why := model_refusal(model)) is not None:
        raise _bad(why, "model")
    for field in ("previous_response_id", "conversation"):
        if req.get(field) is not None:
            raise _bad(f"`{field}` is not supported: this gateway stores no responses, so there is none to continue "
                       "from; send the whole conversation as `input` (earlier output items included)", field)
    if req.get("background") is True:
        raise _bad("`background` is not supported: this gateway stores no responses; stream instead", "background")
    messages = _items(req.get("input"))
    instructions = req.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("`instructions` must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    out: dict = {"model": model, "messages": messages}
    cap = req.get("max_output_tokens")
    if cap is not None:
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_TOKENS:
            raise _bad("`max_output_tokens` must be an integer from 1", "max_output_tokens")
        out["max_tokens"] = cap
    if req.get("tools"):
        out["tools"] = _tools(req["tools"])
        if req.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(req["tool_choice"])
        if isinstance(req.get("parallel_tool_calls"), bool):
            out["parallel_tool_calls"] = req["parallel_tool_calls"]
    for field in ("temperature", "top_p"):
        v = req.get(field)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise _bad(f"`{field}` must be a number", field)
            out[field] = v
    fmt = _format(req.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    if isinstance(req.get("user"), str):
        out["user"] = req["user"]
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("`stream` must be true or false", "stream")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # response.completed carries the counts
    return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _usage(usage: Any) -> dict:
    u = usage if isinstance(usage, dict) else {}
    p, c = _int(u.get("prompt_tokens")), _int(u.get("completion_tokens"))
    details = u.get("prompt_tokens_details") if isinstance(u.get("prompt_tokens_details"), dict) else {}
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": _int(details.get("cached_tokens"))},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Shape:
    """What a Response object echoes of its request, and its id and creation time."""

    def __init__(self, req: dict):
        self.id = _id("resp_")
        self.created = int(time.time())
        self.model = req["model"]
        self.echo = {"instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
                     "metadata": req.get("metadata") if isinstance(req.get("metadata"), dict) else {},
                     "parallel_tool_calls": req.get("parallel_tool_calls", True),
                     "temperature": req.get("temperature"), "top_p": req.get("top_p"),
                     "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
                     "text": req.get("text") if isinstance(req.get("text"), dict) else {"format": {"type": "text"}}}

    def response(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
                "output": output, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "store": False, "truncation": "disabled", "usage": usage, "user": None, **self.echo}


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or status == "completed" else []}


def _call(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _id("fc_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def answer(data: bytes, shape: Shape) -> bytes:
    """A whole chat completion answer as a Response object; 502 when it is not one."""
    try:
        chat = json.loads(data)
        choice = chat["choices"][0]
        msg = choice["message"]
        assert isinstance(msg, dict)
    except (ValueError, KeyError, IndexError, TypeError, AssertionError):
        raise errors.upstream_failed("its answer is not a chat completion") from None
    output: list[dict] = []
    if isinstance(msg.get("content"), str) and msg["content"]:
        output.append(_message(msg["content"]))
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            output.append(_call(str(call.get("id") or _id("call_")), str(fn.get("name", "")),
                                args if isinstance(args, str) else json.dumps(args)))
    incomplete = "max_output_tokens" if choice.get("finish_reason") == "length" else (
        "content_filter" if choice.get("finish_reason") == "content_filter" else None)
    return json.dumps(shape.response("incomplete" if incomplete else "completed", output, _usage(chat.get("usage")),
                                     incomplete)).encode()


class ResponsesStream:
    """A chat completion stream (complete events, then `[DONE]`; an error event before it when the engine
    failed) as Responses events, each with its `sequence_number`: `response.created`,
    `response.in_progress`; for text `response.output_item.added`, `response.content_part.added`,
    `response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`,
    `response.output_item.done`; for a function call `response.output_item.added`,
    `response.function_call_arguments.delta`s and `.done`, `response.output_item.done`; then
    `response.completed` (or `response.incomplete` at the length cap). A failed stream ends with `error`
    and `response.failed`. Chunks of no known shape are skipped."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.seq = 0
        self.started = False
        self.ended = False
        self.output: list[dict] = []  # finished items
        self.item: dict | None = None  # the open item
        self.key: Any = None  # "text", or ("tool", chat index) of the open function call
        self.finish: str | None = None
        self.usage: dict | None = None

    def _ev(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"

    def _begin(self, parts: list[bytes]) -> None:
        self.started = True
        r = self.shape.response("in_progress", [], None)
        parts.append(self._ev("response.created", response=r))
        parts.append(self._ev("response.in_progress", response=r))

    def feed(self, out: bytes) -> bytes:
        if self.ended or not out:
            return b""
        parts: list[bytes] = []
        for obj in chat_events(out):
            if obj == "[DONE]":
                parts.append(self._end())
                break
            if isinstance(obj.get("error"), dict) or obj.get("type") == "error":
                err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
                parts.append(self._fail(err.get("message") if isinstance(err.get("message"), str)
                                        else "the engine failed", err.get("code") if isinstance(err.get("code"), str)
                                        else "engine_error"))
                break
            self._chunk(obj, parts)
        return b"".join(parts)

    def _open(self, parts: list[bytes], key: Any, item: dict) -> None:
        self._close(parts)
        self.key, self.item = key, item
        parts.append(self._ev("response.output_item.added", output_index=len(self.output), item=item))
        if key == "text":
            parts.append(self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))

    def _close(self, parts: list[bytes]) -> None:
        item = self.item
        if item is None:
            return
        i = len(self.output)
        if self.key == "text":
            text = item.pop("_text")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            parts.append(self._ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=text, logprobs=[]))
            parts.append(self._ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))
            item.update(status="completed", content=[part])
        else:
            parts.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=item["arguments"]))
            item["status"] = "completed"
        parts.append(self._ev("response.output_item.done", output_index=i, item=item))
        self.output.append(item)
        self.item = self.key = None

    def _chunk(self, obj: dict, parts: list[bytes]) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        choices = obj.get("choices")
        if not self.started and (choices or "usage" in obj):
            self._begin(parts)
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.key != "text":
                self._open(parts, "text", {**_message("", "in_progress"), "_text": ""})
            assert self.item is not None
            self.item["_text"] += text
            parts.append(self._ev("response.output_text.delta", item_id=self.item["id"],
                                  output_index=len(self.output), content_index=0, delta=text, logprobs=[]))
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            key = ("tool", call.get("index", 0))
            if self.key != key or call.get("id"):
                self._open(parts, key, _call(str(call.get("id") or _id("call_")), str(fn.get("name") or ""), "",
                                             "in_progress"))
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                assert self.item is not None
                self.item["arguments"] += args
                parts.append(self._ev("response.function_call_arguments.delta", item_id=self.item["id"],
                                      output_index=len(self.output), delta=args))
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]

    def _end(self) -> bytes:
        parts: list[bytes] = []
        if not self.started:
            self._begin(parts)
        self._close(parts)
        self.ended = True
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(self.finish or "")
        r = self.shape.response("incomplete" if incomplete else "completed", self.output, self.usage, incomplete)
        parts.append(self._ev("response.incomplete" if incomplete else "response.completed", response=r))
        return b"".join(parts)

    def _fail(self, message: str, code: str | None) -> bytes:
        self.ended = True
        parts: list[bytes] = []
        if not self.started:
            self._begin(parts)
        parts.append(self._ev("error", code=code, message=message, param=None))
        r = self.shape.response("failed", self.output, self.usage, error={"code": code or "server_error",
                                                                             "message": message})
        parts.append(self._ev("response.failed", response=r))
        return b"".join(parts)

    def error(self, err: APIError) -> bytes:
        """The stream's end when the gateway fails it (held through a load that failed, a judged answer refused)."""
        if self.ended:
            return b""
        return self._fail(err.message, err.code)


class ResponsesDoor:
    """One Responses request at the gateway's door (gateway/proxy.py calls it)."""

    path = "/v1/responses"

    def __init__(self) -> None:
        self.shape: Shape | None = None

    def request(self, body: bytes) -> dict:
        req = decode_request(body)
        chat = to_chat(req)
        self.shape = Shape(req)
        return chat

    @staticmethod
    def error_body(err: APIError) -> bytes:
        return err.body()

    def answer(self, data: bytes) -> bytes:
        assert self.shape is not None
        return answer(data, self.shape)

    def stream(self) -> ResponsesStream:
        assert self.shape is not None
        return ResponsesStream(self.shape)
