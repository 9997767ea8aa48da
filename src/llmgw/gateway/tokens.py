"""Token usage as engines report it (issue 15): the `usage` object of an OpenAI-compatible answer.

- A non-streamed answer carries `usage` in its JSON body (`prompt_tokens`, `completion_tokens`,
  `total_tokens`; embeddings only `prompt_tokens` and `total_tokens`).
- A streamed one carries it only when the request asked, with `stream_options: {"include_usage": true}`:
  OpenAI and vLLM then send one last chunk before `[DONE]` with `"choices": []` and `usage` (and OpenAI
  `"usage": null` in every chunk before it); llama.cpp's server may put `usage` on its last content chunk.
  vLLM's `continuous_usage_stats` puts a running total in every chunk: the last one seen counts.

For an accounted request that did not ask, the gateway asks on the client's behalf (`ask_usage`) and
drops the usage-only chunk again before the client sees it (`read_events(strip=True)`); a chunk that also
carries content is relayed as it is. Counts are read from bytes the relay already has: one search per
relayed chunk, and a JSON decode only of an event or body tail that holds a `usage` object.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.http import errors

USAGE = b'"usage"'
MAX_COUNT = (1 << 31) - 1  # per request and kind: more than any engine's context; a wilder figure is capped
_TAIL = 4096  # a body's usage object is looked for in this many bytes after its key
_DECODER = json.JSONDecoder()
_ASK = b', "stream_options": {"include_usage": true}}'
_USUAL = re.compile(rb'"usage"\s*:\s*\{\s*"prompt_tokens"\s*:\s*([0-9]+)\s*,\s*"completion_tokens"\s*:\s*([0-9]+)')
_FLAT = re.compile(rb'"usage"\s*:\s*\{([^{}"]*(?:"[a-z_]+"[^{}"]*)*)\}')  # an object of plain keys and numbers
_FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|total_tokens)"\s*:\s*([0-9]+)')

Counts = tuple[int, int]  # (prompt tokens, completion tokens)


def _count(v: Any) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return min(v, MAX_COUNT)
    return None


def counts(usage: Any) -> Counts | None:
    """(prompt, completion) from a `usage` object, or None when it holds no count. Without
    `completion_tokens` (embeddings), completion is `total_tokens - prompt_tokens`."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    total = _count(usage.get("total_tokens"))
    if prompt is None and completion is None and total is None:
        return None
    if completion is None:
        completion = max(0, (total or 0) - (prompt or 0))
    return prompt or 0, completion


def _flat_counts(inner: bytes) -> Counts | None:
    """`counts` of a flat usage object's inside, from its digits (the common case, kept cheap)."""
    prompt = completion = total = None
    for k, v in _FIELD.findall(inner):
        n = min(int(v), MAX_COUNT) if len(v) < 19 else MAX_COUNT
        if k == b"prompt_tokens":
            prompt = n
        elif k == b"completion_tokens":
            completion = n
        else:
            total = n
    if prompt is None and completion is None and total is None:
        return None
    if completion is None:
        completion = max(0, (total or 0) - (prompt or 0))
    return prompt or 0, completion


def _object_after(data: bytes, i: int) -> Any:
    """The JSON value that follows `"usage"` at `data[i:]` (after its colon), when it is an object."""
    j = i + len(USAGE)
    while j < len(data) and data[j] in b" \t\r\n":
        j += 1
    if data[j:j + 1] != b":":
        return None
    j += 1
    while j < len(data) and data[j] in b" \t\r\n":
        j += 1
    if data[j:j + 1] != b"{":
        return None  # `"usage": null` (OpenAI's chunks before the last), or not a key at all
    try:
        return _DECODER.raw_decode(data[j:j + _TAIL].decode("utf-8", "replace"))[0]
    except ValueError:
        return None


def usage_of_body(data: bytes) -> Counts | None:
    """The counts of a non-streamed answer's `usage`. Inside JSON strings quotes are escaped, so `"usage"`
    followed by a colon is a key; the last one is taken, which is the top-level one as engines write it.
    A flat usage object (no nested `*_details`), as most engines write it, is read with two regular
    expressions; any other with the JSON decoder."""
    i = data.rfind(USAGE)
    if i >= 0:
        m = _USUAL.match(data, i)
        if m is not None:  # `{"prompt_tokens": P, "completion_tokens": C`, as OpenAI, vLLM, llama.cpp write it
            p, c = m.groups()
            if len(p) < 10 and len(c) < 10:  # nine digits are below MAX_COUNT
                return int(p), int(c)
            return (min(int(p), MAX_COUNT) if len(p) < 19 else MAX_COUNT,
                    min(int(c), MAX_COUNT) if len(c) < 19 else MAX_COUNT)
        m = _FLAT.match(data, i)
        if m is not None:
            found = _flat_counts(m.group(1))
            if found is not None:
                return found
    while i >= 0:
        found = counts(_object_after(data, i))
        if found is not None:
            return found
        i = data.rfind(USAGE, 0, i)
    return None


def read_events(out: bytes, strip: bool) -> tuple[bytes, Counts | None]:
    """Complete SSE events (as `SSEFrames.feed` returns them) -> (the events to relay, the last usage they
    carry or None). With `strip`, an event whose only business is usage (no `choices`, or empty ones) is
    dropped."""
    found = None
    kept = []
    dropped = False
    for event in out.split(b"\n\n"):
        i = event.find(USAGE)
        if i < 0 or _object_after(event, i) is None:
            kept.append(event)
            continue
        payload = b"\n".join(line[5:] for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            kept.append(event)
            continue
        c = counts(obj.get("usage")) if isinstance(obj, dict) else None
        if c is None:
            kept.append(event)
            continue
        found = c
        if strip and not obj.get("choices"):
            dropped = True
            continue
        kept.append(event)
    return (b"\n\n".join(kept) if dropped else out), found


def ask_usage(req: dict, body: bytes) -> tuple[dict, bytes, bool]:
    """A streaming request that did not ask for usage, made to ask: (request, body, whether the usage chunk
    must be stripped again). A request that asked is returned as it is; one whose `stream_options` is not
    an object, or whose `include_usage` is not a boolean, is a 400 naming the field."""
    if req.get("stream") is not True:
        return req, body, False
    opts = req.get("stream_options")
    if opts is None and "stream_options" not in req:
        # The body is a JSON object (parse_request): close it with the option instead of encoding it again.
        return {**req, "stream_options": {"include_usage": True}}, body.rstrip()[:-1] + _ASK, True
    if opts is not None and not isinstance(opts, dict):
        raise errors.bad_request("`stream_options` must be an object", param="stream_options")
    include = (opts or {}).get("include_usage")
    if include is True:
        return req, body, False
    if include is not None and not isinstance(include, bool):
        raise errors.bad_request("`stream_options.include_usage` must be true or false",
                                 param="stream_options.include_usage")
    req = {**req, "stream_options": {**(opts or {}), "include_usage": True}}
    return req, json.dumps(req).encode(), True
