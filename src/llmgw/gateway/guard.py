"""Guard policy: a model with `role: guard` judges the requests and/or responses of models whose `guard:`
names it (seeds 003, "A judge model on the cluster"). The judge is a catalog model like any other: it is
routed, balanced, loaded on demand and kept alive by use through the same gateway.

The judge gets the conversation as chat messages of text holding all that the model's template renders
(`conversation`: tool calls, names and reasoning in each message; `tools` and `response_format` at the head
of the first user turn; a completion prompt and its suffix become one user message); for a response check
the whole answer (content, reasoning and tool calls, a stream's pieces put together) is appended as the
assistant's turn. Plain text turns are what guard models such as Llama Guard read through their chat
template. The judge answers with a verdict: its first word `safe` or `no`
allows; `unsafe` or `yes` refuses (the rest, for example Llama Guard's category `S1`, is quoted in the
refusal). Anything else, or a judge that cannot answer, fails closed: the request is not served unjudged.

A response check needs the whole answer before anything reaches the client, so a streamed answer for a
model with `check: [response]` is held until the judge has spoken.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from llmgw.gateway.openai_api import RENDERED
from llmgw.http import errors
from llmgw.schemas.catalog import GuardPolicy

# (model, path, payload) -> (status, decoded JSON body or None); routes like any request.
Call = Callable[[str, str, dict, Any], Awaitable[tuple[int, Any]]]  # model, path, payload, isolation
VERDICT_TOKENS = 16
REASONING = ("reasoning_content", "reasoning")  # vLLM and SGLang; OpenRouter and others
# What the gateway itself refuses to send the judge (Proxy.call): the client's request is wrong, not the judge away.
JUDGE_REFUSES = ("context_length_exceeded", "unsupported_content")


def conversation(path: str, req: dict) -> list[dict]:
    """The request as the judge reads it: chat messages whose `content` is text, holding all that the
    model's chat template renders (issue 36: the judge had seen `messages` only). Each message's text parts,
    its `name`, its tool calls (`[tool call NAME: ARGUMENTS]`) and reasoning; the request's `tools`,
    `response_format` and the other fields of `openai_api.RENDERED`, as JSON, at the head of the first user
    turn (judges such as Llama Guard read user and assistant turns only). A completion prompt (and its
    `suffix`) is one user message."""
    if path.endswith("/chat/completions"):
        out = [{"role": m.get("role"), "content": message_text(m)} if isinstance(m, dict) else m
               for m in req.get("messages") or []]
        offered = {f: req[f] for f in RENDERED if req.get(f) is not None}
        if offered:
            said = "[what the request offers the model: " + json.dumps(offered, ensure_ascii=False) + "]"
            first = next((m for m in out if isinstance(m, dict) and m.get("role") == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": said})
            else:
                first["content"] = said + "\n\n" + first["content"]
        return out
    prompt = req.get("prompt")
    if isinstance(prompt, list):
        if not all(isinstance(p, str) for p in prompt):  # token ids: the judge would read nothing of them
            raise errors.not_text("prompt")
        prompt = "\n".join(prompt)
    if not isinstance(prompt, str):
        raise errors.not_text("prompt")
    suffix = req.get("suffix")
    if isinstance(suffix, str) and suffix:
        prompt += "\n[suffix: " + suffix + "]"
    return [{"role": "user", "content": prompt}]


def message_text(m: dict) -> str:
    """A chat message (or answer message, or stream delta) as text: its content (text parts joined), and
    what else it carries that the model reads or wrote: `name`, reasoning, tool calls, a refusal."""
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    out = [content] if isinstance(content, str) and content else []
    for field in REASONING:
        if isinstance(m.get(field), str) and m[field]:
            out.append(f"[reasoning: {m[field]}]")
    calls = m.get("tool_calls")
    if isinstance(m.get("function_call"), dict):  # the legacy single call
        calls = [{"function": m["function_call"]}, *(calls if isinstance(calls, list) else [])]
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False) if args is not None else ""
            out.append(f"[tool call {fn.get('name') or ''}: {args}]")
    if isinstance(m.get("refusal"), str) and m["refusal"]:
        out.append(m["refusal"])
    if isinstance(m.get("name"), str) and m["name"]:
        out.insert(0, f"[{m['name']}]")
    return "\n".join(out)


def choice_text(obj: Any) -> str:
    """The text of every choice in one decoded answer or stream chunk (chat message/delta, or completion)."""
    out = []
    for c in (obj.get("choices") or []) if isinstance(obj, dict) else []:
        if not isinstance(c, dict):
            continue
        msg = c.get("message") or c.get("delta") or {}
        content = msg.get("content") if isinstance(msg, dict) else None
        out.append(content if isinstance(content, str) else c.get("text") or "")
    return "".join(out)


def answer_parts(obj: Any) -> str:
    """Everything the model wrote in one decoded answer or stream chunk, for a response check: each
    choice's content or text, and its reasoning and tool calls (issue 36: they had gone unjudged)."""
    out = []
    for c in (obj.get("choices") or []) if isinstance(obj, dict) else []:
        if not isinstance(c, dict):
            continue
        msg = c.get("message") or c.get("delta")
        if isinstance(msg, dict):
            out.append(message_text(msg))
        elif isinstance(c.get("text"), str):
            out.append(c["text"])
    return "".join(out)


def answer_text(body: bytes, sse: bool) -> str:
    """What the model wrote in an OpenAI answer, streamed (SSE events) or not: content, reasoning and tool
    calls (`answer_parts`). A stream's deltas are put together first, per choice and per tool call (a
    call's arguments arrive in pieces), so the judge reads each call whole."""
    if not sse:
        try:
            return answer_parts(json.loads(body))
        except (ValueError, UnicodeDecodeError):
            return ""
    choices: dict[int, dict] = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            obj = json.loads(line[5:])
        except ValueError:
            continue
        for c in (obj.get("choices") or []) if isinstance(obj, dict) else []:
            if isinstance(c, dict):
                _merge(choices.setdefault(c.get("index") if isinstance(c.get("index"), int) else 0, {}), c)
    for m in choices.values():  # tool calls by their index, as a message carries them
        m["tool_calls"] = [calls[i] for i in sorted(calls)] if (calls := m.get("tool_calls")) else []
    return "".join(message_text(m) for _, m in sorted(choices.items()))


def _merge(into: dict, choice: dict) -> None:
    """Add one stream chunk's choice (`delta`, or a completion's `text`) to the message built so far."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        delta = {"content": choice["text"]} if isinstance(choice.get("text"), str) else {}
    for field in ("content", "refusal", *REASONING):
        if isinstance(delta.get(field), str):
            into[field] = into.get(field, "") + delta[field]
    for call in delta.get("tool_calls") or [] if isinstance(delta.get("tool_calls"), list) else []:
        if not isinstance(call, dict):
            continue
        calls: dict[int, dict] = into.setdefault("tool_calls", {})
        fn = calls.setdefault(call.get("index") if isinstance(call.get("index"), int) else len(calls),
                              {"function": {"name": "", "arguments": ""}})["function"]
        part = call.get("function") if isinstance(call.get("function"), dict) else {}
        for key in ("name", "arguments"):
            if isinstance(part.get(key), str):
                fn[key] += part[key]


def verdict(text: str) -> tuple[bool | None, str]:
    """(allowed, detail): True for `safe`/`no`, False for `unsafe`/`yes`, None when there is no verdict."""
    words = text.strip().split(None, 1)
    if not words:
        return None, ""
    first = words[0].strip(".,:;!\"'").lower()
    detail = " ".join(words[1].split()) if len(words) > 1 else ""
    if first in ("safe", "no"):
        return True, ""
    if first in ("unsafe", "yes"):
        return False, detail[:200]
    return None, text.strip()[:200]


class Guard:
    """Runs a policy's judge through `call` and turns its verdict into a pass or an `APIError`."""

    def __init__(self, call: Call):
        self.call = call

    async def judge(self, policy: GuardPolicy, stage: str, messages: list[dict], param: str | None,
                    iso: Any = None) -> None:
        """Raises `errors.content_filter` (400) when the judge refuses, `errors.guard_unavailable` (503)
        when it cannot judge; returns when it allows."""
        payload = {"model": policy.model, "messages": messages, "max_tokens": VERDICT_TOKENS, "temperature": 0,
                   "stream": False}
        try:
            status, body = await self.call(policy.model, "/v1/chat/completions", payload, iso)
        except errors.APIError as exc:
            if exc.code in JUDGE_REFUSES:  # the prompt cannot be judged as sent: retrying will not help
                raise
            raise errors.guard_unavailable(policy.model, exc.message,
                                           int(exc.headers.get("Retry-After", "10"))) from None
        if status != 200 or not isinstance(body, dict):
            raise errors.guard_unavailable(policy.model, f"it answered HTTP {status}")
        allowed, detail = verdict(choice_text(body))
        if allowed is None:
            raise errors.guard_unavailable(policy.model, f"its answer is not a verdict: {detail!r}")
        if not allowed:
            raise errors.content_filter(policy.model, stage, detail, param)
