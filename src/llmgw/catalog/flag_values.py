"""The values of engine flags that take a number, checked when the catalog is applied.

Why (the stop-25 walkthrough): `--ctx-size 4O96` (a letter O) was applied, and llama-server read it as 4:
the model served with a context of 4 tokens, and the gateway's prompt bound (catalog/context.py), which
reads the same flag, fell back to its widest setting. `--parallel two` was applied too, and the engine
then exited with code 1 at every start. An engine reads a number the way C's `stoi` or Python's `int`
does, so a typo is either a crash minutes later or a silently different number; here it is a 400 at apply
naming the flag, the value and what to write.

Only flags whose values are numbers are listed; the engine policy (catalog/policy.py) decides which flags
are allowed at all, and calls `check_value` for each value it reads.
"""

from __future__ import annotations

import re

INT = re.compile(r"-?\d+")
FLOAT = re.compile(r"-?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
HUMAN = re.compile(r"\d+(\.\d+)?[kmgKMG]?|-1|auto")  # vLLM's human-readable integers (1k = 1000, 1K = 1024)

_INT, _FLOAT, _HUMAN = "an integer", "a number", "an integer (or 32k, 32K, -1, auto)"
KINDS = {_INT: INT, _FLOAT: FLOAT, _HUMAN: HUMAN}

VALUES: dict[str, dict[str, str]] = {
    "llamacpp": {
        **dict.fromkeys((
            "--ctx-size", "--parallel", "--threads", "--threads-batch", "--threads-http", "--n-predict", "--batch-size",
            "--ubatch-size", "--keep", "--cache-reuse", "--ctx-checkpoints", "--n-cpu-moe", "--main-gpu", "--seed",
            "--top-k", "--reasoning-budget", "--timeout", "--yarn-orig-ctx", "--cache-ram"), _INT),
        **dict.fromkeys((
            "--temp", "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty", "--frequency-penalty",
            "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--defrag-thold"), _FLOAT),
    },
    "vllm": {
        "--max-model-len": _HUMAN, "--max-num-batched-tokens": _HUMAN,
        **dict.fromkeys((
            "--max-num-seqs", "--seed", "--block-size", "--max-logprobs", "--max-log-len",
            "--long-prefill-token-threshold"), _INT),
        **dict.fromkeys(("--gpu-memory-utilization", "--cpu-offload-gb"), _FLOAT),
    },
    "sglang": {
        **dict.fromkeys((
            "--max-running-requests", "--max-total-tokens", "--max-prefill-tokens", "--chunked-prefill-size",
            "--context-length", "--random-seed", "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--torch-compile-max-bs", "--page-size",
            "--stream-interval"), _INT),
        **dict.fromkeys(("--mem-fraction-static", "--schedule-conservativeness", "--watchdog-timeout"), _FLOAT),
    },
    "sim": {**dict.fromkeys(("--tokens-per-second", "--startup-delay", "--join-timeout", "--sleep-s", "--wake-s",
                                  "--compile-s"), _FLOAT),
            "--gpu-memory-mb": _INT},
}


def value_kind(engine: str, flag: str) -> str | None:
    """What `flag` of `engine` takes ("an integer", ..., "a revision"), when its value is checked; else None."""
    if (engine, flag) in REVISIONS:
        return "a revision (a branch, a tag or a commit sha)"
    return VALUES.get(engine, {}).get(flag)


# The context flags (catalog/context.py reads them too): a context of more tokens than any model has is a
# typo, and the engine would try to hold its KV cache (`--ctx-size 999999999` grew llama-server to 10 GB
# before the memory hold stopped it; node/health.py). 2**24 tokens is above the longest context of any
# released model (10M). 0 (llama.cpp) and -1 or auto (vLLM) mean the model's own.
MAX_CONTEXT_TOKENS = 1 << 24
CONTEXT = {("llamacpp", "--ctx-size"): 0, ("vllm", "--max-model-len"): -1, ("sglang", "--context-length"): 1}
C_INT_MAX = (1 << 31) - 1  # llama.cpp reads integers with `std::stoi`: a larger one ends it at start
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# A hub revision: a branch, a tag or a commit of the repository, never a pull request's ref, which anyone
# may open on a public repository: `--revision refs/pr/1` would serve a stranger's weights (and code) under
# the catalog's model name.
REVISIONS = {("vllm", "--revision"), ("vllm", "--tokenizer-revision"), ("vllm", "--code-revision"),
             ("sglang", "--revision")}


def value_problem(engine: str, flag: str, value: str) -> str | None:
    """Why `value` is not a value `flag` takes, or None when it is (or the flag takes no checked value)."""
    if (engine, flag) in REVISIONS:
        if "refs/pr/" in value.strip().lower():
            return (f"{flag} {value[:60]!r} is a pull request of the repository, which anyone may open; give a "
                    "branch, a tag or a commit sha")
        return None
    kind = value_kind(engine, flag)
    v = value.strip()
    if kind is None:
        return None
    if not KINDS[kind].fullmatch(v):
        return f"{flag} takes {kind}, not {value[:40]!r}"
    if v == "auto" or kind == _FLOAT:
        return None
    n = int(float(v[:-1]) * _SCALE[v[-1]]) if v[-1] in _SCALE and v[-1].isalpha() else int(float(v))
    least = CONTEXT.get((engine, flag))
    if least is not None and not least <= n <= MAX_CONTEXT_TOKENS:
        own = {0: "; 0 takes the model's own", -1: "; -1 or auto takes the model's own"}.get(least, "")
        return (f"{flag} is a context length in tokens, from {least} to {MAX_CONTEXT_TOKENS} (2**24, above any "
                f"model's), not {value[:40]}{own}")
    if engine == "llamacpp":
        lo, hi = (-1, (1 << 32) - 1) if flag == "--seed" else (-C_INT_MAX - 1, C_INT_MAX)  # the seed is unsigned
        if not lo <= n <= hi:
            return f"{flag} takes an integer from {lo} to {hi} (what llama-server can read), not {value[:40]}"
    return None
