"""Streams that survive their replica (issue 38): the splice of a stream continued on another replica.

When the engine of a stream dies (its connection breaks) or stalls (it has streamed, then sent nothing for
the model's `routing.stream_resume.stall_s`) before `[DONE]`, the gateway asks another Ready replica of the
same model for the rest of the answer and relays it as the same stream (gateway/proxy.py):

- **chat**: the text relayed so far becomes the final assistant message, sent with
  `continue_final_message: true` and `add_generation_prompt: false` (vLLM's fields, which SGLang took
  (sglang#4226), and llama-server reads too (llama.cpp#23012), which since llama.cpp#13174 prefills a final
  assistant message anyway unless started with `--no-prefill-assistant`). A client that already sent a final
  assistant message with `continue_final_message` has the text appended to it;
- **completions**: the text so far is appended to the prompt;
- a length cap (`max_tokens`, `max_completion_tokens`, llama.cpp's `n_predict`) is lowered by what was
  generated, counted as the content events relayed (engines stream one token an event; an engine that
  batches several an event is given a little more than the cap allows);
- the continuation's events are rewritten into the first answer's: its `id` and `created`, the choice
  index 0, no second `role`; its `usage` is the whole answer's: prompt tokens of the original prompt (the
  continuation's less the generated prefix) and completion tokens of both.

What cannot be continued is refused by `refusal` (the request) and `Splice.blocked` (what was streamed):
`n > 1`, `best_of`, logprobs, `echo`, structured output (a grammar restarted mid-answer would hold the
continuation to a whole document), a forced tool call, tool calls or reasoning already streamed, a prompt
that is not text. A chat continuation goes only to a replica whose engine continues a final message
(`continues_chat`: vLLM, SGLang, the sim engine, llama.cpp without `--no-prefill-assistant`; not a static
endpoint, whose engine is unknown). Such a stream, or one whose attempts are used, ends as before: one error
event, then `[DONE]`.

Cost on the hot path: a resumable stream keeps references to the events it relayed (no copy); they are
parsed only when it breaks, or once they exceed `FOLD_BYTES`, in one batch (so a long stream holds at most
that much beside its text).
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.schemas.catalog import Profile

CHAT = "/v1/chat/completions"
FOLD_BYTES = 64 << 10  # relayed events held unparsed per stream before they are folded into its text
CAPS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "grammar",
              "json_schema")


def continues_chat(profile: Profile) -> bool:
    """Whether an engine run by `profile` continues a chat's final assistant message when asked."""
    if profile.engine in ("vllm", "sglang", "sim"):
        return True
    if profile.engine == "llamacpp":
        off = "--no-prefill-assistant" in profile.args or profile.env.get("LLAMA_ARG_NO_PREFILL_ASSISTANT") not in (
            None, "", "0", "false")
        return not off
    return False


def refusal(path: str, req: dict) -> str | None:
    """Why the stream of request `req` (to `path`) cannot be continued elsewhere, or None if it can."""
    if req.get("n") not in (None, 1):
        return "n > 1"
    if req.get("best_of") not in (None, 1):
        return "best_of"
    if req.get("logprobs") or req.get("top_logprobs") or req.get("prompt_logprobs"):
        return "logprobs"
    if req.get("echo"):
        return "echo"
    fmt = req.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(req.get(k) for k in STRUCTURED):
        return "structured output"
    if path == CHAT:
        choice = req.get("tool_choice")
        if req.get("tools") and (choice == "required" or isinstance(choice, dict)):
            return "a forced tool call"
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        if req.get("continue_final_message") and not _text_message(messages[-1]):
            return "a final message that is not text"
        return None
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return None if isinstance(prompt, str) else "a prompt that is not one text"


def _text_message(m: object) -> bool:
    return isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)


class Splice:
    """One resumable stream: what it relayed (`keep`), what that says (`fold`), the continuation to ask for
    (`request`) and its events as the client's (`rewrite`). `attempts`: continuations left."""


    __slots__ = ("chat", "req", "attempts", "raw", "raw_bytes", "text", "events", "id", "created", "blocked",
                 "finished", "legs", "prefix_tokens", "stall_s")

    def __init__(self, path: str, req: dict, attempts: int, stall_s: float | None = None):
        self.chat = path == CHAT
        self.req = req
        self.attempts = attempts
        self.stall_s = stall_s  # silence after which the engine is taken for stalled (None: not watched)
        self.raw: list[bytes] = []
        self.raw_bytes = 0
        self.text: list[str] = []  # choice 0's text as relayed
        self.events = 0  # events that carried text (about the tokens generated)
        self.id: str | None = None  # the answer's id and created, from its first event
        self.created: Any = None
        self.blocked: str | None = None  # why what was streamed cannot be continued
        self.finished = False  # a finish_reason or usage was relayed: the answer is whole
        self.legs = 1  # engines that served this stream
        self.prefix_tokens = 0  # the generated text the current continuation was asked with, in events

    # ---- the relayed events ---------------------------------------------------------------------
    def keep(self, out: bytes) -> None:
        """Note `out`, complete events just relayed to the client."""
        self.raw.append(out)
        self.raw_bytes += len(out)
        if self.raw_bytes > FOLD_BYTES:
            self.fold()

    def fold(self) -> None:
        """Read the events kept so far into the text, the counts and `blocked`."""
        data, self.raw, self.raw_bytes = b"".join(self.raw), [], 0
        payloads = []
        for payload in _payloads(data):
            if payload == b"[DONE]":
                self.finished = True
            else:
                payloads.append(payload)
        if not payloads:
            return
        # One JSON text for every event (one call into the decoder, not one per event: issue 42, where the
        # per-event calls were most of a long stream's relay cost); an event that is not JSON makes the
        # batch fail, and then each is read on its own to find it.
        try:
            objs = json.loads(b"[" + b",".join(payloads) + b"]")
            if len(objs) != len(payloads):  # ("1,2" is one event whose payload reads as two values)
                raise ValueError("an event held several values")
        except ValueError:
            objs = []
            for payload in payloads:
                try:
                    objs.append(json.loads(payload))
                except ValueError:
                    self.blocked = "an event that is not JSON"
        for obj in objs:
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                self.blocked = "an error event"
                continue
            if self.id is None and isinstance(obj.get("id"), str):
                self.id, self.created = obj["id"], obj.get("created")
            if obj.get("usage") and not obj.get("choices"):
                self.finished = True
            for choice in obj.get("choices") or ():
                self._choice(choice)

    def _choice(self, choice: object) -> None:
        if not isinstance(choice, dict):
            return
        if choice.get("index", 0) != 0:
            self.blocked = "several choices"
            return
        if choice.get("logprobs"):
            self.blocked = "logprobs"
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return
            if delta.get("tool_calls") or delta.get("function_call"):
                self.blocked = "tool calls streamed"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.blocked = "reasoning streamed"
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text.append(text)
            self.events += 1

    # ---- the continuation -----------------------------------------------------------------------
    def why_not(self) -> str | None:
        """Why this stream cannot be continued now (after `fold`), or None."""
        if self.blocked:
            return self.blocked
        if self.attempts <= 0:
            return "its attempts are used"
        return None

    def request(self) -> dict | None:
        """The continuation's request body (as JSON-ready dict), or None when the cap is already reached
        (the answer is whole but for its end)."""
        text = "".join(self.text)
        self.prefix_tokens = self.events
        body = dict(self.req)
        for cap in CAPS:
            v = body.get(cap)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                if v - self.events < 1:
                    return None
                body[cap] = v - self.events
        v = body.get("n_predict")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            if v - self.events < 1:
                return None
            body["n_predict"] = v - self.events
        if not text:
            return body
        if self.chat:
            messages = list(body["messages"])
            if body.get("continue_final_message") and _text_message(messages[-1]):
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
            else:
                messages.append({"role": "assistant", "content": text})
            body["messages"] = messages
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            prompt = body["prompt"]
            body["prompt"] = [prompt[0] + text] if isinstance(prompt, list) else prompt + text
        return body

    def rewrite(self, out: bytes) -> bytes:
        """A continuation's complete events (`out`, from `SSEFrames.feed`) as the client's stream: the first
        answer's id and created, no second role, its usage the whole answer's. `[DONE]`, comments and error
        events pass as they are."""
        parts = []
        for event in out.split(b"\n\n"):
            if not event:
                continue
            payload = b"\n".join(ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:"))
            if not payload or payload == b"[DONE]" or not payload.startswith(b"{"):
                parts.append(event + b"\n\n")
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                parts.append(event + b"\n\n")
                continue
            if not isinstance(obj, dict) or "error" in obj:
                parts.append(event + b"\n\n")
                continue
            if self.id is None:
                self.id, self.created = obj.get("id"), obj.get("created")
            else:
                obj["id"] = self.id
                if self.created is not None:
                    obj["created"] = self.created
            choices = [c for c in (obj.get("choices") or []) if self._keep_choice(c)]
            usage = obj.get("usage")
            if obj.get("choices") and not choices and not usage:
                continue  # only the continuation's opening role
            obj["choices"] = choices
            if isinstance(usage, dict):
                obj["usage"] = self._usage(usage)
            parts.append(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
        return b"".join(parts)

    def _keep_choice(self, choice: object) -> bool:
        if not isinstance(choice, dict):
            return True
        if self.chat and isinstance(choice.get("delta"), dict):
            delta = choice["delta"]
            delta.pop("role", None)
            if not delta.get("content") and len(delta) <= 1 and choice.get("finish_reason") is None \
                    and not choice.get("logprobs"):
                return False
        return True

    def _usage(self, usage: dict) -> dict:
        """The continuation's usage as the whole answer's. Its prompt held the prefix, about `events` tokens
        (`prefix_tokens`)."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return usage
        before = self.prefix_tokens
        out = dict(usage)
        out["prompt_tokens"] = max(1, prompt - before)
        out["completion_tokens"] = completion + before
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out


def _payloads(data: bytes):
    """Each event's `data:` payload (its lines joined), as bytes."""
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: ") and b"\n" not in event:  # (an engine's event: one line of data)
            yield event[6:].strip()
            continue
        lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)
