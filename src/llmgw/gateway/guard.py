"""Guard policy: a model with `role: guard` judges the requests and/or responses of models whose `guard:`
names it (seeds 003, "A judge model on the cluster"). The judge is a catalog model like any other: it is
routed, balanced, loaded on demand and kept alive by use through the same gateway.

The judge gets the conversation as chat messages (a completion prompt becomes one user message; for a
response check the answer is appended as the assistant's turn), which is how guard models such as Llama
Guard read it through their chat template, and answers with a verdict: its first word `safe` or `no`
allows; `unsafe` or `yes` refuses (the rest, for example Llama Guard's category `S1`, is quoted in the
refusal). Anything else, or a judge that cannot answer, fails closed: the request is not served unjudged.

A response check needs the whole answer before anything reaches the client, so a streamed answer for a
model with `check: [response]` is held until the judge has spoken.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from llmgw.http import errors
from llmgw.schemas.catalog import GuardPolicy

# (model, path, payload) -> (status, decoded JSON body or None); routes like any request.
Call = Callable[[str, str, dict], Awaitable[tuple[int, Any]]]
VERDICT_TOKENS = 16
# What the gateway itself refuses to send the judge (Proxy.call): the client's request is wrong, not the judge away.
JUDGE_REFUSES = ("context_length_exceeded", "unsupported_content")


def conversation(path: str, req: dict) -> list[dict]:
    """The request as chat messages: `messages` itself, or a completion `prompt` as one user message."""
    if path.endswith("/chat/completions"):
        return list(req.get("messages") or [])
    prompt = req.get("prompt")
    if isinstance(prompt, list):
        if not all(isinstance(p, str) for p in prompt):  # token ids: the judge would read nothing of them
            raise errors.not_text("prompt")
        prompt = "\n".join(prompt)
    if not isinstance(prompt, str):
        raise errors.not_text("prompt")
    return [{"role": "user", "content": prompt}]


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


def answer_text(body: bytes, sse: bool) -> str:
    """The assistant's text in an OpenAI answer, streamed (SSE events) or not."""
    if not sse:
        try:
            return choice_text(json.loads(body))
        except (ValueError, UnicodeDecodeError):
            return ""
    parts = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                parts.append(choice_text(json.loads(line[5:])))
            except ValueError:
                continue
    return "".join(parts)


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

    async def judge(self, policy: GuardPolicy, stage: str, messages: list[dict], param: str | None) -> None:
        """Raises `errors.content_filter` (400) when the judge refuses, `errors.guard_unavailable` (503)
        when it cannot judge; returns when it allows."""
        payload = {"model": policy.model, "messages": messages, "max_tokens": VERDICT_TOKENS, "temperature": 0,
                   "stream": False}
        try:
            status, body = await self.call(policy.model, "/v1/chat/completions", payload)
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
