"""The longest prompt a model takes: its prompt bound, from the context its profiles give their engines.

Why (a walkthrough finding of stop 24): the gateway takes bodies up to `max_request_bytes` (64 MiB, for
images), and an engine refuses a prompt longer than its context only after tokenizing all of it. A 50 MB
prompt held a llama-server slot for 59.5 s before its 400. The gateway holds no tokenizer, but it can
count characters, and a prompt whose text is longer than `CHARS_PER_TOKEN` characters for every token of
context does not fit: natural text runs about 4 characters a token, code about 3, Chinese or Japanese one
or fewer. Only text made of a tokenizer's rare long tokens (runs of `=` or of spaces) could fit and still
be refused; an operator who serves such text sets `limits.max_prompt_chars`.

A model's bound, in order:
1. its `limits.max_prompt_chars`, when set (the operator's word: no cap applies);
2. else, when every profile declares its context (llama.cpp `--ctx-size` or `LLAMA_ARG_CTX_SIZE`, vLLM
   `--max-model-len`, SGLang `--context-length`), `CHARS_PER_TOKEN` × the largest, at most the setting;
3. else the setting `max_prompt_chars` (OpenAI's own ceiling for one string: 10,485,760 characters).

What one choice of a request that sets no length cap may generate (`output_bound`, issue 37), reserved
against an accounted key's budgets: `limits.max_output_tokens` (also sent to the engine, which would not
stop there by itself), else the declared context (an engine stops there anyway), else the context the prompt
bound implies (its characters / `CHARS_PER_TOKEN`).

The gateway counts a request's text as its engine renders it (gateway/openai_api.py `prompt_chars`: messages
with their names, tool calls and reasoning, `tools`, `response_format` schemas, a completion's `suffix`) and
refuses a longer one with
400 `context_length_exceeded` before it is routed, queued, counted against a quota or loads a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.catalog.policy import read_flag, rules_for
from llmgw.schemas.catalog import Model, Profile

CHARS_PER_TOKEN = 32
MAX_PROMPT_CHARS = 10_485_760  # the default of the setting `max_prompt_chars`: OpenAI's limit on one string

# engine -> the flag that sets its context length in tokens
CONTEXT_FLAGS = {"llamacpp": "--ctx-size", "vllm": "--max-model-len", "sglang": "--context-length"}
LLAMA_CTX_ENV = "LLAMA_ARG_CTX_SIZE"  # llama-server reads it when --ctx-size is not given
# vLLM reads `--max-model-len` as a human-readable number: 1k = 1000, 1K = 1024 (and m/M, g/G).
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class PromptBound:
    """The most characters of text one prompt of a model may hold, and why: `context` is the declared
    context (tokens) it comes from, None when it is the model's limit or the setting (`source`)."""

    chars: int
    source: str  # "limits.max_prompt_chars", "context" or "max_prompt_chars"
    context: int | None = None


def _tokens(value: str, engine: str) -> int | None:
    m = _HUMAN.fullmatch(value.strip())
    if m is None or (engine != "vllm" and (m.group(2) or "." in m.group(1))):
        return None
    n = int(float(m.group(1)) * _SCALE[m.group(2)])
    return n if n > 0 else None  # 0 (llama.cpp) or -1 (vLLM): the model's own, which the catalog cannot see


def declared_context(profile: Profile) -> int | None:
    """The context length (tokens) one request of `profile`'s engine may use, as its args or env give it, or
    None when they give none (the engine then takes the model's own, which only the weights know). For
    llama.cpp that is one slot's share: `--ctx-size` is the KV cache of all `--parallel` slots, each held to
    ctx / parallel tokens unless the cache is unified (`--kv-unified`, llama-server's default only when
    `--parallel` is left to it). Seen on llama-server: `--ctx-size 4096 --parallel 2` logs
    `n_ctx_slot = 2048, kv_unified = 'false'`, and refuses a 3,000-token prompt the gateway had let through."""
    flag = CONTEXT_FLAGS.get(profile.engine)
    if flag is None:
        return None
    try:
        values = flag_values(profile)
    except ValueError:
        return None  # a form the policy refuses: the catalog is refused anyway
    found = values.get(flag)
    if found is None and profile.engine == "llamacpp":
        found = profile.env.get(LLAMA_CTX_ENV)
    context = _tokens(found, profile.engine) if found is not None else None
    if context is None or profile.engine != "llamacpp":
        return context
    return context // llama_slots(values, profile.env)


def flag_values(profile: Profile) -> dict[str, str | None]:
    """Each flag in `profile.args` (normalised as its engine reads it) with the value given it last (as
    every engine's parser takes it), None for a flag given no value, in the order they were given last.
    Raises ValueError for a form the policy refuses."""
    rules = rules_for(profile.engine)
    values: dict[str, str | None] = {}
    args = profile.args
    for i, arg in enumerate(args):
        name = read_flag(arg, rules)
        if name is None:
            continue
        values.pop(name, None)  # the order of the dict is the order each flag was given last
        if "=" in arg and rules.split_equals:
            values[name] = arg.split("=", 1)[1]
        else:
            following = args[i + 1] if i + 1 < len(args) else None
            values[name] = following if following is not None and read_flag(following, rules) is None else None
    return values


_LLAMA_TRUE = {"1", "true", "on", "enabled"}  # how llama.cpp reads a boolean LLAMA_ARG_* variable


def llama_slots(values: dict[str, str | None], env: dict[str, str]) -> int:
    """How many slots share llama-server's `--ctx-size`: `--parallel` when given and the KV cache is not
    unified, else 1 (a unified cache lets one request use all of it)."""
    raw = values.get("--parallel") or env.get("LLAMA_ARG_N_PARALLEL")
    try:
        parallel = int(raw) if raw is not None else -1
    except ValueError:
        return 1
    if parallel <= 1:
        return 1  # -1 (auto): four slots over a unified cache
    if "--no-kv-unified" in values or "--kv-unified" in values:
        unified = list(values).index("--kv-unified") > list(values).index("--no-kv-unified") \
            if "--no-kv-unified" in values and "--kv-unified" in values else "--kv-unified" in values
    else:
        unified = env.get("LLAMA_ARG_KV_UNIFIED", "").strip().lower() in _LLAMA_TRUE
    return 1 if unified else parallel


def text_only(model: Model) -> bool:
    """True when no replica of `model` can read images or audio: every profile is llama.cpp, whose
    multimodal projector (`--mmproj`) the engine policy refuses (it reads a file outside the weight cache).
    llama-server answers such a part with a 500, which a client would retry; the gateway says 400 first."""
    return bool(model.profiles) and not model.endpoints and all(p.engine == "llamacpp" for p in model.profiles)


def prompt_bound(model: Model, most: int = MAX_PROMPT_CHARS) -> PromptBound:
    """`model`'s prompt bound (the module docstring); `most`: the setting `max_prompt_chars`."""
    if model.limits is not None and model.limits.max_prompt_chars is not None:
        return PromptBound(model.limits.max_prompt_chars, "limits.max_prompt_chars")
    contexts = [declared_context(p) for p in model.profiles]
    if contexts and None not in contexts:
        context = max(c for c in contexts if c is not None)
        if context * CHARS_PER_TOKEN < most:
            return PromptBound(context * CHARS_PER_TOKEN, "context", context)
    return PromptBound(most, "max_prompt_chars")


@dataclass(frozen=True)
class OutputBound:
    """The most tokens one choice of a request that sets no length cap may generate, and why. `forward`:
    the engine must be told (`max_tokens`), since it would not stop there by itself; an engine stops at its
    context anyway, and sending the context as `max_tokens` would make vLLM refuse every request (prompt +
    max_tokens must fit the context)."""

    tokens: int
    source: str  # "limits.max_output_tokens", "context" or "prompt bound"
    forward: bool = False


def output_bound(model: Model, bound: PromptBound) -> OutputBound:
    """`model`'s output bound (the module docstring), beside its prompt bound `bound`."""
    if model.limits is not None and model.limits.max_output_tokens is not None:
        return OutputBound(model.limits.max_output_tokens, "limits.max_output_tokens", True)
    if bound.context is not None:
        return OutputBound(bound.context, "context")
    contexts = [declared_context(p) for p in model.profiles]
    if contexts and None not in contexts:  # a bound set by limits.max_prompt_chars, a context declared
        return OutputBound(max(c for c in contexts if c is not None), "context")
    return OutputBound(max(1, bound.chars // CHARS_PER_TOKEN), "prompt bound")
