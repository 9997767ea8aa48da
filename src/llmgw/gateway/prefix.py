"""The key prefix-aware balancing routes by (issue 37): a hash of a request's cache salt and the leading
`PREFIX_CHARS` characters of its prompt, the part an engine's prefix cache would find again.

Requests that begin alike (a shared system prompt, the earlier turns of one conversation, few-shot
examples) get the same key, so the balancer sends them to the replica that most likely holds their
prefix (gateway/balancer.py). The salt is part of the key: a tenant's prompts never share a key with
another's, since their engines' caches never share a block (gateway/isolation.py).

Bounded so that the hot path stays cheap whatever the prompt: at most `PREFIX_CHARS` characters of text are
read and hashed (one BLAKE2b of at most ~4 KiB), a chat's messages in order (each role, then the text of
its `content`: a string, or the `text` of each text part; other parts, such as images, count as their
type), a completion's `prompt` (its first, when it is a list; token ids as numbers). A prompt shorter than
that is keyed whole, so only requests alike from their first character to the `PREFIX_CHARS`th share a
replica: prompts that share less than that are spread as unrelated ones.
"""

from __future__ import annotations

import hashlib

PREFIX_CHARS = 1024  # about 256 tokens, 16 of vLLM's blocks of 16
_SEP = "\x1f"


def _chat_text(messages: list, limit: int) -> str:
    out: list[str] = []
    n = 0
    for m in messages:
        if n >= limit:
            break
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        piece = role if isinstance(role, str) else ""
        content = m.get("content")
        if isinstance(content, str):
            piece += _SEP + content[:limit - n]
        elif isinstance(content, list):
            for part in content[:64]:  # a few parts reach `limit` anyway
                if isinstance(part, dict):
                    text = part.get("text")
                    kind = part.get("type")
                    piece += _SEP + (text[:limit - n] if isinstance(text, str) else kind if isinstance(kind, str) else "")
                if len(piece) >= limit - n:
                    break
        piece = piece[:limit - n] + _SEP
        out.append(piece)
        n += len(piece)
    return "".join(out)


def _prompt_text(prompt: object, limit: int) -> str:
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first[:limit]
        if isinstance(first, int):  # token ids
            return ",".join(str(t) for t in prompt[:limit // 4] if isinstance(t, int))
        if isinstance(first, list):  # a batch of token-id lists
            return ",".join(str(t) for t in first[:limit // 4] if isinstance(t, int))
    return ""


def prefix_key(path: str, req: dict, salt: str | None, model: str = "") -> int:
    """A 64-bit key of the serving `model`, the request's salt and its leading `PREFIX_CHARS` characters of
    prompt."""
    if path == "/v1/chat/completions":
        messages = req.get("messages")
        text = _chat_text(messages, PREFIX_CHARS) if isinstance(messages, list) else ""
    else:
        text = _prompt_text(req.get("prompt"), PREFIX_CHARS)
    h = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8)
    if salt:
        h.update(salt[:256].encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(text.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "big")
