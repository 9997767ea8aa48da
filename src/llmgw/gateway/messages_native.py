"""A Messages request passed through to an engine that serves `/v1/messages` itself (gateway/dialects.py).

The request sent is the client's own, with the gateway's rules applied to it as to its translation
(gateway/messages.py): the model's name the serving replica knows (an alias or a fallback rewritten), the
`max_tokens` its budget admitted (gateway/quotas.py clamps the translation's; the same cap is sent here),
the tenant's cache salt where the model isolates tenants. The answer is relayed as the engine wrote it;
its `usage` (`input_tokens`, with `cache_read_input_tokens` and `cache_creation_input_tokens`, which
Anthropic counts apart from it, and `output_tokens`) is what the request is charged.

A stream keeps Anthropic's framing: `event:` and `data:` lines (clients dispatch on `event:`), events
relayed once complete, ended at `message_stop`; an event of a type not in Anthropic's list (an engine newer
than its clients) is dropped, so no client meets a type it does not know; a stream the engine breaks off or
ends early ends with one `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.gateway.sse import complete_events
from llmgw.gateway.tokens import MAX_COUNT, Counts

PATH = "/v1/messages"
EVENTS = frozenset({"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "ping", "error"})


def request(original: dict, model: str, chat: dict) -> dict:
    """The body to send: the client's request as decoded, with the serving model's name and the length cap
    the gateway admitted (`chat`: the request's translation as admitted)."""
    out = {**original, "model": model}
    if isinstance(chat.get("max_tokens"), int):
        out["max_tokens"] = chat["max_tokens"]
    return out


def _n(v: Any) -> int:
    return min(v, MAX_COUNT) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def counts(usage: Any, prior: Counts | None = None) -> Counts | None:
    """(prompt, completion) of an Anthropic `usage`; a field it lacks keeps its `prior` count (a stream's
    `message_delta` may carry only `output_tokens`)."""
    if not isinstance(usage, dict):
        return prior
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    prompt = sum(_n(usage.get(k)) for k in keys) if any(k in usage for k in keys) else (prior or (0, 0))[0]
    completion = _n(usage["output_tokens"]) if "output_tokens" in usage else (prior or (0, 0))[1]
    return min(prompt, MAX_COUNT), completion


def counts_of_message(data: bytes) -> Counts | None:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return counts(doc.get("usage")) if isinstance(doc, dict) else None


def error_event(message: str, kind: str = "api_error", code: str | None = None) -> bytes:
    return b"event: error\ndata: " + json.dumps({"type": "error", "error": {"type": kind, "message": message,
                                                                            "code": code}}).encode() + b"\n\n"


def _from_openai(event: bytes) -> bytes:
    """An OpenAI error event (gateway/openai_api.py `sse_error`) as Anthropic's."""
    try:
        err = json.loads(event.split(b"data:", 1)[1])["error"]
        return error_event(str(err.get("message")), "overloaded_error" if err.get("code") == "overloaded"
                           else "api_error", err.get("code"))
    except (IndexError, KeyError, ValueError, AttributeError, TypeError):
        return error_event("the engine's stream failed")


class NativeFrames:
    """An engine's Anthropic stream, fed chunk by chunk, as `SSEFrames` is for chat streams (same methods):
    complete events with their `event:` and `data:` lines, unknown types dropped, `done` at `message_stop`
    (or the engine's `error` event); `counts` the usage it reported; `deltas` the content deltas relayed."""

    __slots__ = ("pending", "done", "counts", "deltas")

    def __init__(self) -> None:
        self.pending = b""
        self.done = False
        self.counts: Counts | None = None
        self.deltas = 0

    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return b""
        out, self.pending = complete_events(self.pending, chunk)
        if not out:
            return b""
        kept = []
        for event in out.split(b"\n\n"):
            lines = [ln for ln in event.split(b"\n") if ln.startswith((b"event:", b"data:"))]
            data = b"\n".join(ln[5:].strip() for ln in lines if ln.startswith(b"data:"))
            if not data:
                continue
            try:
                obj = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                continue
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind not in EVENTS:
                continue
            if kind == "content_block_delta":
                self.deltas += 1
            elif kind == "message_start" and isinstance(obj.get("message"), dict):
                self.counts = counts(obj["message"].get("usage"), self.counts)
            elif kind == "message_delta":
                self.counts = counts(obj.get("usage"), self.counts)
            if not any(ln.startswith(b"event:") for ln in lines):
                lines.insert(0, b"event: " + kind.encode())
            kept.append(b"\n".join(lines) + b"\n\n")
            if kind in ("message_stop", "error"):
                self.done = True
                self.pending = b""
                break
        return b"".join(kept)

    def finish(self, error: bytes) -> bytes:
        """The stream's end once the engine's answer ended: nothing after `message_stop`, else one error
        event (`error`: the gateway's in OpenAI's form, rewritten as Anthropic's)."""
        if self.done:
            return b""
        self.done = True
        self.pending = b""
        return _from_openai(error)

    def broken(self, error: bytes) -> bytes:
        return self.finish(error)
