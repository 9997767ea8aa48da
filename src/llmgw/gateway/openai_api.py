"""The OpenAI API on the wire, for the hot path: reading and checking a request, and writing errors.

The body's shape is bounded before it is parsed whole (http/jsonbody.py: size, depth, element count,
numbers JSON cannot carry). Then only what the gateway relies on is checked (`model`, the one field each
path needs, a few types and ranges); the rest of the body is the engine's to judge and reaches it
untouched. An engine's error answer is rewritten into the OpenAI envelope (http/errors.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, Callable

from llmgw.http import errors
from llmgw.http.errors import APIError
from llmgw.http.jsonbody import JSONRefused, decode
from llmgw.security.logtext import printable

log = logging.getLogger(__name__)

# path -> the field a request must carry besides `model`
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}
MAX_BODY = 64 << 20
MAX_MODEL_NAME = 256
_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}


def model_refusal(model: object) -> str | None:
    """What is wrong with a request's `model` (every door's), saying what to write; None when nothing is."""
    if model is None or model == "":
        return "`model` is required: the name of a model from /v1/models"
    if not isinstance(model, str):
        return (f"`model` must be a string, the name of a model from /v1/models, not "
                f"{_JSON_TYPES.get(type(model), 'that')}")
    if len(model) > MAX_MODEL_NAME:
        return f"`model` is longer than {MAX_MODEL_NAME} characters: no model is named so (see /v1/models)"
    return None
# Counts the gateway bounds because each multiplies an engine's work: OpenAI's own ceilings (`n` 128), and
# token limits within a signed 32-bit integer, which is what engines store them in.
MAX_CHOICES = 128
# Inputs of one embeddings request (OpenAI's ceiling), and prompts of one completions request (the same):
# each is a request's worth of engine work.
MAX_INPUTS = 2048
MAX_TOKENS = (1 << 31) - 1
# (field, least, most). llama.cpp's `n_predict` (-1: until the context is full) and SGLang's
# `max_new_tokens` are length caps too, which an accounted request's reservation clamps (gateway/quotas.py).
COUNTS = (("max_tokens", 1, MAX_TOKENS), ("max_completion_tokens", 1, MAX_TOKENS), ("n", 1, MAX_CHOICES),
          ("best_of", 1, MAX_CHOICES), ("n_predict", -1, MAX_TOKENS), ("max_new_tokens", 0, MAX_TOKENS))

# How each engine says a prompt does not fit its context: llama-server's error type; vLLM's "This model's
# maximum context length is N tokens"; SGLang's "longer than the model's context length".
LLAMA_CONTEXT = "exceed_context_size_error"
CONTEXT_WORDS = re.compile(r"maximum context length is|longer than the model's context length|exceeds the available context size")

_OBJECT = re.compile(rb"[ \t\r\n]*\{")

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


async def read_body(receive: Receive, limit: int = MAX_BODY) -> bytes:
    """The whole request body. Raises ConnectionResetError if the client leaves, 413 when too large."""
    msg = await receive()
    if msg["type"] == "http.disconnect":
        raise ConnectionResetError("client disconnected")
    body = msg.get("body", b"")
    if not msg.get("more_body"):
        return body
    chunks, size = [body], len(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.too_large(limit)
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def _counts(req: dict) -> None:
    for field, least, most in COUNTS:
        if field in req:
            v = req[field]
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not least <= v <= most):
                raise errors.bad_request(f"`{field}` must be an integer from {least} to {most}", param=field)


def parse_request(path: str, body: bytes) -> dict[str, Any]:
    """Decode and check the request; raises a 400 `APIError` naming the field. Only what the gateway
    relies on is checked; everything else is the engine's to judge."""
    if not _OBJECT.match(body):  # before its shape is judged: `[[[...` is not a request however deep
        raise errors.bad_request("the request body must be a JSON object ({\"model\": ..., ...})")
    try:
        req = decode(body)
    except JSONRefused as exc:
        raise errors.bad_request(str(exc), param=exc.param) from None
    if not isinstance(req, dict):
        raise errors.bad_request("the request body must be a JSON object")
    if (why := model_refusal(req.get("model"))) is not None:
        raise errors.bad_request(why, param="model")
    field = REQUIRED[path]
    value = req.get(field)
    if field == "messages":
        if not isinstance(value, list) or not value:
            raise errors.bad_request("`messages` is required: a non-empty list of {role, content} messages",
                                     param="messages")
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise errors.bad_request(f"`messages[{i}]` must be an object with a `role`", param=f"messages[{i}]")
            content = m.get("content")
            if not (content is None or isinstance(content, str)):
                _check_parts(content, i)
            if "tool_calls" in m and not isinstance(m["tool_calls"], list | None):
                raise errors.bad_request(f"`messages[{i}].tool_calls` must be a list of tool calls",
                                         param=f"messages[{i}].tool_calls")
        if "tools" in req and not isinstance(req["tools"], list | None):
            raise errors.bad_request("`tools` must be a list of tools ({\"type\": \"function\", \"function\": {...}})",
                                     param="tools")
    elif value is None:
        raise errors.bad_request(f"`{field}` is required", param=field)
    elif isinstance(value, list) and len(value) > MAX_INPUTS and not all(type(v) is int for v in value):
        raise errors.bad_request(f"`{field}` holds {len(value):,} items; at most {MAX_INPUTS} go in one request: "
                                 "send them in batches", param=field)
    if "stream" in req and not isinstance(req["stream"], bool):
        raise errors.bad_request("`stream` must be true or false", param="stream")
    if field == "input" and req.get("stream") is True:
        raise errors.bad_request("embeddings are not streamed: leave `stream` out", param="stream")
    _counts(req)
    return req


def _check_parts(content: Any, i: int) -> None:
    """A message's `content` that is not a string: a list of parts, each an object with a string `type`, a
    text part with a string `text` (what OpenAI's schema says; llama-server answered 500 to the rest)."""
    where = f"messages[{i}].content"
    if not isinstance(content, list):
        raise errors.bad_request(f"`{where}` must be a string or a list of content parts", param=where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise errors.bad_request(f"`{where}[{j}]` must be an object with a `type` (\"text\", \"image_url\", ...)",
                                     param=f"{where}[{j}]")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise errors.bad_request(f"`{where}[{j}].text` must be a string", param=f"{where}[{j}].text")


# Request fields besides `messages` that a chat template renders into the prompt (vLLM and SGLang render
# `tools` and `documents`, and may take the template itself and its kwargs from the request), or that an
# engine turns into prompt text (`response_format`'s JSON schema, legacy `functions`). Counted whole:
# every string in them, keys included (a JSON schema's property names are rendered too).
RENDERED = ("tools", "functions", "response_format", "documents", "chat_template", "chat_template_kwargs")
_RENDERED = frozenset(RENDERED)
# A message's own fields that are not text to count: its role, and `content`, counted part by part.
_NOT_COUNTED = frozenset(("role", "content"))


def text_len(value: Any) -> int:
    """Characters in every string of a decoded JSON value, object keys included. The body's skeleton
    check bounds its depth (64) and element count, so this walk is bounded too."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + text_len(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(text_len(v) for v in value)
    return 0


def _message_chars(m: dict) -> int:
    content = m.get("content")
    n = 0
    if isinstance(content, str):
        n = len(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                n += len(part["text"])
    if len(m) > 2 or "content" not in m:  # `name`, `tool_calls`, `reasoning_content`, `refusal`, ...
        for k, v in m.items():
            if k not in _NOT_COUNTED:
                n += text_len(v)
    return n


def prompt_chars(path: str, req: dict) -> int:
    """The characters of text in the request's prompt as its engine renders it, as the prompt bound counts
    them (catalog/context.py). A chat: its messages together (string `content`, the `text` of content
    parts, and every other field of a message: `name`, `tool_calls` with their function names and
    arguments, `reasoning_content`, ...; images and other media parts are not text), plus every field of
    `RENDERED` (`tools` with names, descriptions and parameter schemas, `response_format`'s schema, ...).
    A completion: its longest `prompt` plus its `suffix` (each prompt is rendered with it); an
    embedding: its longest `input`. Token-id arrays are not counted: the body's element bound holds them.
    Issue 36: a `tools` entry with a 50 MB description had counted as nothing."""
    if path == "/v1/chat/completions":
        n = 0
        for m in req["messages"]:
            content = m.get("content")
            if type(content) is str and len(m) == 2:  # the common message, {role, content}: no call
                n += len(content)
            else:
                n += _message_chars(m)
        if not _RENDERED.isdisjoint(req):
            for field in RENDERED:
                if field in req:
                    n += text_len(req[field])
        return n
    value = req.get(REQUIRED[path])
    if isinstance(value, str):
        n = len(value)
    elif isinstance(value, list):
        n = max((len(v) for v in value if isinstance(v, str)), default=0)
    else:
        n = 0
    suffix = req.get("suffix") if path == "/v1/completions" else None
    return n + len(suffix) if isinstance(suffix, str) else n


def prompt_param(path: str, req: dict) -> str:
    """The field that holds most of a refused prompt's text (`tools`, `messages`, `suffix`), for the
    refusal's `param`; computed only for a refusal."""
    field = REQUIRED[path]
    if path == "/v1/chat/completions":
        sizes = {f: text_len(req[f]) for f in RENDERED if f in req}
        sizes[field] = sum(_message_chars(m) for m in req["messages"])
        return max(sizes, key=sizes.__getitem__)
    suffix = req.get("suffix") if path == "/v1/completions" else None
    if isinstance(suffix, str) and len(suffix) > prompt_chars(path, {field: req.get(field)}):
        return "suffix"
    return field


def media_part(req: dict) -> str | None:
    """The path of a chat's first content part that is not text (`messages[0].content[1]`), or None."""
    for i, m in enumerate(req["messages"]):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    return f"messages[{i}].content[{j}]"
    return None


def engine_error(status: int, body: bytes) -> APIError:
    """An engine's error answer in our envelope. A 4xx keeps the engine's message, param and code (they are
    about the client's request); a 5xx says only what failed, since an engine's own error text may carry
    its internals (tracebacks, paths), and is logged instead. A 501 is the engine saying, in words it chose,
    that it cannot do what was asked (llama-server's embeddings without `--embeddings`): its JSON message is
    kept (any other body is logged, as a 5xx's) and the client gets 400 `engine_unsupported`, which OpenAI
    clients do not retry."""
    message = param = code = kind = None
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else obj
        if isinstance(err, dict):
            message = err.get("message") if isinstance(err.get("message"), str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
            code = err.get("code") if isinstance(err.get("code"), str) else None
            kind = err.get("type") if isinstance(err.get("type"), str) else None
    except (ValueError, UnicodeDecodeError):
        pass
    if status == 400 and code is None and message is not None and (kind == LLAMA_CONTEXT or CONTEXT_WORDS.search(message)):
        # The prompt did not fit the engine's context: OpenAI's code, which clients that trim a conversation
        # read, whichever engine said it (and without llama.cpp's advice to the operator).
        code, message = "context_length_exceeded", message.removesuffix(", try increasing it")
    # Whose words reach the client: a 4xx's, whatever its shape; a 501's only as its JSON `message`.
    says_why = status < 500 or (status == 501 and message is not None)
    if not says_why:
        log.warning("engine answered HTTP %d: %s", status, printable(body))
        message = "see the gateway's log"
    elif not message:
        message = " ".join(body.decode("utf-8", "replace").split())[:300] or f"HTTP {status}"
    if status == 501 and "Start it with `--" in message:  # the engine's advice, as an llmgw operator acts on it
        message += " (in llmgw: add that flag to the model's profile `args` in the catalog)"
    out = errors.engine_error(status, message)
    if status in (401, 403):
        log.warning("engine answered HTTP %d to the gateway (its key or configuration): %s", status, printable(body))
        return out
    if says_why:
        out.param = param
        if status < 500 and status != 429:
            out.code = code or out.code
    return out


def sse_error(err: APIError) -> bytes:
    return b"data: " + err.body() + b"\n\n"
