"""Engine policy: profile `args` and `env` may tune an engine, never make it run code, touch files, reach
other machines or override what the node worker sets. An allowlist per engine, not a refusal list.

Why an allowlist (issue 11): a list of refused flags is bypassed by whatever the engine's parser reads as
the same flag. vLLM reads `--trust_remote_code` as `--trust-remote-code`; argparse (vLLM, SGLang, the sim
engine) expands an unambiguous prefix (`--trust-remote`, `--hos 0.0.0.0`); llama-server reads
`LLAMA_ARG_<NAME>` from its environment as a flag (`LLAMA_ARG_RPC` sends activations, and so prompts, to
another machine). So each flag is first read the way that engine's parser reads it, then must be named,
whole, in that engine's list:

- only long flags (`--name`); a short one (`-c`) is refused with the advice to write the long form;
- `--name=value` is split at `=` where the engine's parser splits it (argparse: vLLM, SGLang, sim);
  llama-server does not split it, so there it is refused with the advice to pass the value separately;
- `_` reads as `-` where the engine's parser does that (vLLM: in the name up to a `.`; llama-server:
  the whole argument);
- vLLM's dotted JSON arguments (`--compilation-config.level 3`) and `--config FILE` are refused;
- anything else that starts with `-` and is not a number is a flag, and must be on the list: a prefix is
  never expanded here, because the engine would expand it to a flag that is not.

`env`: exact names, from a short list shared by every engine (threads, NCCL and CUDA tuning) plus each
engine's own; for llama.cpp the `LLAMA_ARG_*` names of its allowed flags and nothing else. Variables the
node worker sets (`CUDA_VISIBLE_DEVICES`, the engine's API key, the collectives' interface) are refused
with that reason, and the adapters merge the worker's environment last besides, so it wins anyway.

Checked when the catalog is applied (`catalog/loader.py`: a 400 naming the field, the flag and what is
allowed) and again on the node before an engine starts (`node/activities.py`), whatever sent the profile.
The lists are in docs/catalog.md ("Engine flags and environment").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmgw.catalog.flag_values import value_kind, value_problem
from llmgw.schemas.catalog import Profile
from llmgw.spelling import closest
from llmgw.weights.naming import SourceError, parse_source


class PolicyError(ValueError):
    """A profile asks for env or args the policy refuses; the message says what to write instead."""


@dataclass(frozen=True)
class EngineRules:
    """How one engine's parser reads argv, and what a profile may pass it.

    `flags`: allowed long flags as the engine spells them; `env`: allowed variables (beyond `COMMON_ENV`);
    `worker_flags`: flags its adapter sets itself; `split_equals`: the parser reads `--flag=value`;
    `underscores`: the parser reads `_` as `-` in flag names; `dotted`: the parser reads `--flag.key`
    as a JSON field (vLLM), which is refused.
    """

    engine: str
    flags: frozenset[str]
    env: frozenset[str]
    worker_flags: frozenset[str]
    split_equals: bool = True
    underscores: bool = False
    dotted: bool = False


# Shared by every engine: thread counts and collective/CUDA tuning that names no file, library, plugin,
# address or credential. NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are the worker's (multi-node shards).
COMMON_ENV = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE",
    "NCCL_CUMEM_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "NVIDIA_TF32_OVERRIDE",
})

# Set by the node worker for the engines it launches (engines/base.py, the adapters).
WORKER_ENV = {
    "CUDA_VISIBLE_DEVICES": "the node worker gives each shard exactly the GPUs placement chose",
    "NCCL_SOCKET_IFNAME": "the node worker keeps a multi-node replica's collectives on its advertised address",
    "GLOO_SOCKET_IFNAME": "the node worker keeps a multi-node replica's collectives on its advertised address",
    "VLLM_HOST_IP": "the node worker sets the address a multi-node replica uses",
    "RAY_ADDRESS": "the node worker sets where a multi-node replica's Ray head is",
    "VLLM_API_KEY": "each replica's engine key is the node worker's",
    "LLAMA_API_KEY": "each replica's engine key is the node worker's",
    "LLMGW_SIM_API_KEY": "each replica's engine key is the node worker's",
    "VLLM_SERVER_DEV_MODE": "the node worker opens vLLM's sleep endpoints, behind the engine key, for a model "
                            "with scaling.sleep_after",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "the node worker opens vLLM's adapter load calls, behind the engine key, "
                                        "for a profile with `max_loras`",
    **dict.fromkeys(("VLLM_CACHE_ROOT", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                     "LLMGW_SIM_COMPILE_DIR"),
                    "the node worker points an engine's compile caches at its key's directory on the node "
                    "(compile_cache_gb; docs/architecture.md, \"Compile caches\")"),
}

_COMMON_WORKER_FLAGS = {"--host", "--port", "--model", "--api-key"}

# Reasons for flags people reach for, so the refusal says why rather than only "not on the list".
REFUSED_REASONS = {
    "--trust-remote-code": "engines may not run code shipped with a model",
    "--config": "engines read their flags from the profile, not from a file on the node",
    "--log-file": "the node worker captures engine output itself",
    "--rpc": "llama-server would send activations, and so prompts, to another server",
    "--model-url": "weights are fetched by llmgw into its cache (use `source`)",
    "--hf-repo": "weights are fetched by llmgw into its cache (use `source`)",
    "--hf-file": "weights are fetched by llmgw into its cache (use `source`)",
    "--download-dir": "weights are fetched by llmgw into its cache",
    "--slot-save-path": "engines may not write files on the node",
    "--lora": "engines may not load files outside the weight cache",
    "--lora-modules": "engines may not load files outside the weight cache",
    "--lora-paths": "engines may not load files outside the weight cache",
    "--chat-template-file": "engines may not read arbitrary files; put the template in the model's weights",
    "--grammar-file": "engines may not read arbitrary files",
    "--tool-parser-plugin": "engines may not load plugins",
    "--middleware": "engines may not load code",
    "--worker-extension-cls": "engines may not load code",
    "--worker-cls": "engines may not load code",
    "--enable-custom-logit-processor": "clients could send code for the engine to run",
    "--ssl-keyfile": "engines may not read arbitrary files",
    "--ssl-certfile": "engines may not read arbitrary files",
    "--path": "llama-server may not serve files from the node",
    "--props": "clients could change the engine's settings",
    "--no-slots": "the node worker reads /slots to know when a draining engine is idle",
    "--tools": "clients could run the engine's built-in tools on the node",
    "--webui": "engines serve no UI",
    "--mmproj": "engines may not read files outside the weight cache",
    "--allowed-local-media-path": "engines may not read arbitrary files",
}

# Checked against vLLM's own parser (tests/test_engine_parsers.py, vLLM 0.32): the flags it had dropped by then
# (--swap-space, --rope-theta, --rope-scaling, --num-scheduler-steps, --guided-decoding-backend, ...) are gone.
VLLM = EngineRules(
    engine="vllm", underscores=True, dotted=True,
    flags=frozenset({
        "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization",
        "--kv-cache-dtype", "--dtype", "--quantization", "--seed", "--block-size", "--cpu-offload-gb", "--enforce-eager",
        "--optimization-level",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
        "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "--async-scheduling", "--scheduling-policy",
        "--disable-custom-all-reduce", "--enable-expert-parallel", "--disable-sliding-window", "--disable-cascade-attn",
        "--max-logprobs", "--disable-log-stats", "--enable-log-requests", "--max-log-len",
        "--uvicorn-log-level", "--revision", "--tokenizer-revision",
        "--limit-mm-per-prompt", "--mm-processor-kwargs", "--override-generation-config", "--enable-auto-tool-choice",
        "--tool-call-parser", "--reasoning-parser", "--response-role",
        "--return-tokens-as-token-ids",
    }),
    env=frozenset({
        "VLLM_ATTENTION_BACKEND", "VLLM_USE_V1", "VLLM_LOGGING_LEVEL", "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_FLASHINFER_FORCE_TENSOR_CORES", "VLLM_ENGINE_ITERATION_TIMEOUT_S",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_USE_DEEP_GEMM", "VLLM_ALL2ALL_BACKEND", "VLLM_FUSED_MOE_CHUNK_SIZE",
        "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_RPC_TIMEOUT", "VLLM_MLA_DISABLE", "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
    }),
    worker_flags=frozenset(_COMMON_WORKER_FLAGS | {
        "--served-model-name", "--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-executor-backend",
        "--data-parallel-size", "--enable-sleep-mode", "--enable-lora", "--max-loras", "--max-lora-rank"}),
)

# Checked by hand against SGLang 0.5.23's parser (`ServerArgs.add_cli_args`; PyPI `sglang --no-deps`, issue
# 35: its full install needs `cuda-tile` from NVIDIA's index): `--cuda-graph-max-bs` had become two flags.
SGLANG = EngineRules(
    engine="sglang",
    flags=frozenset({
        "--mem-fraction-static", "--max-running-requests", "--max-total-tokens", "--max-prefill-tokens",
        "--chunked-prefill-size", "--context-length", "--dtype", "--kv-cache-dtype", "--quantization",
        "--schedule-policy", "--schedule-conservativeness", "--random-seed", "--attention-backend",
        "--sampling-backend", "--grammar-backend", "--disable-radix-cache", "--disable-cuda-graph",
        "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--enable-torch-compile", "--torch-compile-max-bs", "--enable-mixed-chunk",
        "--disable-overlap-schedule", "--page-size", "--stream-interval", "--watchdog-timeout", "--log-level",
        "--log-requests", "--revision", "--tool-call-parser", "--reasoning-parser",
    }),
    env=frozenset(),
    worker_flags=frozenset(_COMMON_WORKER_FLAGS | {
        "--model-path", "--served-model-name", "--tp", "--tp-size", "--tensor-parallel-size", "--pp-size",
        "--enable-metrics", "--dist-init-addr", "--nnodes", "--node-rank", "--dp", "--dp-size", "--base-gpu-id",
        "--enable-memory-saver"}),
)

# llama-server's tuning flags and the environment variable each is read from (None: it has none), as
# `llama-server --help` prints them (tests/test_engine_policy.py checks them against the installed binary).
LLAMACPP_FLAGS: dict[str, str | None] = {
    "--threads": "LLAMA_ARG_THREADS", "--threads-batch": None, "--threads-http": "LLAMA_ARG_THREADS_HTTP",
    "--ctx-size": "LLAMA_ARG_CTX_SIZE", "--n-predict": "LLAMA_ARG_N_PREDICT", "--batch-size": "LLAMA_ARG_BATCH",
    "--ubatch-size": "LLAMA_ARG_UBATCH", "--parallel": "LLAMA_ARG_N_PARALLEL", "--keep": None,
    "--cont-batching": "LLAMA_ARG_CONT_BATCHING", "--no-cont-batching": "LLAMA_ARG_CONT_BATCHING",
    "--flash-attn": "LLAMA_ARG_FLASH_ATTN", "--swa-full": "LLAMA_ARG_SWA_FULL",
    "--cache-type-k": "LLAMA_ARG_CACHE_TYPE_K", "--cache-type-v": "LLAMA_ARG_CACHE_TYPE_V",
    "--defrag-thold": "LLAMA_ARG_DEFRAG_THOLD", "--cache-ram": "LLAMA_ARG_CACHE_RAM",
    "--cache-reuse": "LLAMA_ARG_CACHE_REUSE", "--cache-prompt": "LLAMA_ARG_CACHE_PROMPT",
    "--no-cache-prompt": "LLAMA_ARG_CACHE_PROMPT", "--kv-unified": "LLAMA_ARG_KV_UNIFIED",
    "--no-kv-unified": "LLAMA_ARG_KV_UNIFIED", "--context-shift": "LLAMA_ARG_CONTEXT_SHIFT",
    "--no-context-shift": "LLAMA_ARG_CONTEXT_SHIFT", "--ctx-checkpoints": "LLAMA_ARG_CTX_CHECKPOINTS",
    "--rope-scaling": "LLAMA_ARG_ROPE_SCALING_TYPE", "--rope-scale": "LLAMA_ARG_ROPE_SCALE",
    "--rope-freq-base": "LLAMA_ARG_ROPE_FREQ_BASE", "--rope-freq-scale": "LLAMA_ARG_ROPE_FREQ_SCALE",
    "--yarn-orig-ctx": "LLAMA_ARG_YARN_ORIG_CTX", "--load-mode": "LLAMA_ARG_LOAD_MODE", "--numa": "LLAMA_ARG_NUMA",
    "--cpu-moe": "LLAMA_ARG_CPU_MOE", "--n-cpu-moe": "LLAMA_ARG_N_CPU_MOE",
    "--tensor-split": "LLAMA_ARG_TENSOR_SPLIT", "--main-gpu": "LLAMA_ARG_MAIN_GPU",
    "--seed": None, "--temp": "LLAMA_ARG_TEMPERATURE", "--top-k": "LLAMA_ARG_TOP_K", "--top-p": "LLAMA_ARG_TOP_P",
    "--min-p": "LLAMA_ARG_MIN_P", "--repeat-penalty": "LLAMA_ARG_REPEAT_PENALTY",
    "--presence-penalty": "LLAMA_ARG_PRESENCE_PENALTY", "--frequency-penalty": "LLAMA_ARG_FREQUENCY_PENALTY",
    "--pooling": "LLAMA_ARG_POOLING", "--embeddings": "LLAMA_ARG_EMBEDDINGS", "--reranking": "LLAMA_ARG_RERANKING",
    "--timeout": "LLAMA_ARG_TIMEOUT", "--metrics": "LLAMA_ARG_ENDPOINT_METRICS", "--jinja": "LLAMA_ARG_JINJA",
    "--no-jinja": "LLAMA_ARG_JINJA", "--chat-template": "LLAMA_ARG_CHAT_TEMPLATE",
    "--chat-template-kwargs": "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "--reasoning-format": "LLAMA_ARG_THINK",
    "--reasoning-budget": "LLAMA_ARG_THINK_BUDGET",
}

LLAMACPP = EngineRules(
    engine="llamacpp", split_equals=False, underscores=True,
    flags=frozenset(LLAMACPP_FLAGS),
    env=frozenset(e for e in LLAMACPP_FLAGS.values() if e),
    worker_flags=frozenset(_COMMON_WORKER_FLAGS | {
        "--alias", "--n-gpu-layers", "--split-mode", "--no-webui"}),
)

SIM = EngineRules(
    engine="sim",
    flags=frozenset({"--tokens-per-second", "--startup-delay", "--join-timeout", "--prefix-cache-blocks",
                     "--prefill-tokens-per-second", "--gpu-memory-mb", "--sleep-s", "--wake-s",
                     "--ignore-sigterm", "--lora-load-s", "--engine-version", "--compile-s"}),
    env=frozenset(),
    worker_flags=frozenset(_COMMON_WORKER_FLAGS | {"--rank", "--world-size", "--rendezvous", "--token",
                                                   "--max-loras"}),
)

# llama-server's variables for flags with a reason in REFUSED_REASONS, to say which flag a variable is.
LLAMA_ENV_FLAGS = {
    "LLAMA_ARG_RPC": "--rpc", "LLAMA_ARG_MODEL_URL": "--model-url", "LLAMA_ARG_HF_REPO": "--hf-repo",
    "LLAMA_ARG_HF_FILE": "--hf-file", "LLAMA_ARG_LOG_FILE": "--log-file", "LLAMA_ARG_STATIC_PATH": "--path",
    "LLAMA_ARG_ENDPOINT_PROPS": "--props", "LLAMA_ARG_TOOLS": "--tools", "LLAMA_ARG_MMPROJ": "--mmproj",
    "LLAMA_ARG_CHAT_TEMPLATE_FILE": "--chat-template-file", "LLAMA_ARG_ENDPOINT_SLOTS": "--no-slots",
}

_ENV_FLAG = {e: f for f, e in LLAMACPP_FLAGS.items() if e}  # LLAMA_ARG_CTX_SIZE -> --ctx-size (the first flag reading it)
RULES: dict[str, EngineRules] = {r.engine: r for r in (VLLM, SGLANG, LLAMACPP, SIM)}
LLAMA_ARG_PREFIX = "LLAMA_ARG_"
_NUMBER = re.compile(r"-(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def rules_for(engine: str) -> EngineRules:
    try:
        return RULES[engine]
    except KeyError:
        raise PolicyError(f"unknown engine {engine!r} (known: {', '.join(sorted(RULES))})") from None


# Short flags people copy from engines' READMEs, and the long form the advice names (llama.cpp's `arg.cpp`,
# vLLM's and SGLang's argument parsers); any other short flag gets the general advice.
SHORT_FLAGS: dict[str, dict[str, str]] = {
    "llamacpp": {"-c": "--ctx-size", "-np": "--parallel", "-t": "--threads", "-tb": "--threads-batch",
                 "-b": "--batch-size", "-ub": "--ubatch-size", "-fa": "--flash-attn", "-n": "--n-predict",
                 "-ctk": "--cache-type-k", "-ctv": "--cache-type-v", "-s": "--seed"},
    "vllm": {"-q": "--quantization"},
}


def read_flag(arg: str, rules: EngineRules) -> str | None:
    """The flag `arg` is to `rules.engine`'s parser, normalised as that parser normalises it; None for a
    value. Raises `PolicyError` for a form the policy does not accept (short flags, `--`, `=` where the
    parser does not split it, vLLM's dotted JSON arguments)."""
    if not arg.startswith("-") or arg == "-" or _NUMBER.fullmatch(arg):
        return None
    if arg == "--":
        raise PolicyError("args: a bare `--` ends the engine's options; remove it")
    if not arg.startswith("--"):
        long = SHORT_FLAGS.get(rules.engine, {}).get(arg)
        raise PolicyError(f"args: short flags such as {arg!r} are not accepted; write the long form "
                          + (f"({long})" if long else "(--name)"))
    name = arg
    if "=" in arg:
        if not rules.split_equals:
            flag, value = arg.split("=", 1)
            raise PolicyError(f"args: {arg}: {rules.engine} does not read --flag=value; write the flag and its value "
                              f"as two items: {json.dumps(flag)}, {json.dumps(value)}")
        name = arg.split("=", 1)[0]
    if rules.underscores:
        head, dot, rest = name[2:].partition(".")
        name = "--" + head.replace("_", "-") + dot + (rest if rules.dotted else rest.replace("_", "-"))
    if rules.dotted and "." in name:
        raise PolicyError(f"args: {name}: dotted JSON arguments are not accepted; pass the whole value to an "
                          "allowed flag")
    return name


def check_args(args: list[str], engine: str) -> None:
    """Raise `PolicyError` for the first arg `engine` may not be given (argv list, never a shell string)."""
    problems = args_problems(args, engine)
    if problems:
        raise PolicyError(problems[0])


def args_problems(args: list[str], engine: str) -> list[str]:
    """Every problem of `args` for `engine`, in order, each with what to write instead (issue 44: the catalog
    had said only the first, and each fix was one more apply)."""
    rules = rules_for(engine)
    problems: list[str] = []
    listed = False  # the allowed flags are listed once
    waiting: str | None = None  # a flag that takes a number, before its value
    for arg in args:
        try:
            if not isinstance(arg, str):
                raise PolicyError(f"args must be strings, got {arg!r}")
            if "\x00" in arg or "\n" in arg or "\r" in arg:
                raise PolicyError(f"arg {arg!r} contains a control character")
            flag = read_flag(arg, rules)
        except PolicyError as exc:
            problems.append(str(exc))
            waiting = None
            continue
        if waiting is not None:
            problems += _value_problems(engine, waiting, None if flag is not None else arg)
            waiting = None
            if flag is None:
                continue
        if flag is None:
            continue
        if flag in rules.flags:
            if value_kind(engine, flag):
                if "=" in arg and rules.split_equals:
                    problems += _value_problems(engine, flag, arg.split("=", 1)[1])
                else:
                    waiting = flag
            continue
        problems.append(_refused_flag(arg, flag, rules, engine, listed))
        listed = listed or flag not in rules.worker_flags and flag not in REFUSED_REASONS
    if waiting is not None:
        problems += _value_problems(engine, waiting, None)
    return problems


def _refused_flag(arg: str, flag: str, rules: EngineRules, engine: str, listed: bool) -> str:
    as_read = f" ({engine} reads {arg.split('=', 1)[0]!r} as {flag})" if flag != arg.split("=", 1)[0] else ""
    if flag in rules.worker_flags:
        hint = " (use `source` for the weights)" if flag in ("--model", "--model-path") else ""
        return f"args: {flag} is set by the node worker{as_read}; remove it{hint}"
    why = REFUSED_REASONS.get(flag)
    reason = f": {why}" if why else ""
    best = closest(flag, rules.flags, cutoff=0.8) if not why else None
    hint = f" (did you mean {best}?)" if best else ""
    allowed = "The allowed flags are listed above." if listed else \
        f"Allowed {engine} flags: {', '.join(sorted(rules.flags))}"
    return (f"args: {arg.split('=', 1)[0]} is not an allowed {engine} flag{as_read}{reason}{hint}. Flags are matched "
            f"whole (an engine would expand a prefix to a flag that is not allowed). {allowed}")


def _value_problems(engine: str, flag: str, value: str | None) -> list[str]:
    if value is None:
        return [f"args: {flag} takes {value_kind(engine, flag)}; write it as the next item"]
    problem = value_problem(engine, flag, value)
    return [f"args: {problem}"] if problem is not None else []


def check_env(env: dict[str, str], engine: str) -> None:
    """Raise `PolicyError` for the first env name `engine` may not be given (see the module docstring)."""
    problems = env_problems(env, engine)
    if problems:
        raise PolicyError(problems[0])


def env_problems(env: dict[str, str], engine: str) -> list[str]:
    """Every env name or value `engine` may not be given, each with what to write instead."""
    rules = rules_for(engine)
    allowed = COMMON_ENV | rules.env
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            problems.append(f"env: {name!r} is not an upper-case variable name")
        elif not isinstance(value, str) or "\x00" in value:
            problems.append(f"env: {name} must be a string without NUL characters")
        elif name in WORKER_ENV:
            problems.append(f"env: {name} is set by the node worker ({WORKER_ENV[name]}); remove it")
        elif name in allowed:
            flag = _ENV_FLAG.get(name) if engine == "llamacpp" else None
            problem = value_problem(engine, flag, value) if flag else None
            if problem is not None:
                problems.append(f"env: {name} (llama-server's {problem})")
        elif name.startswith(LLAMA_ARG_PREFIX) and engine == "llamacpp":
            flag = LLAMA_ENV_FLAGS.get(name)
            why = f" ({flag}: {REFUSED_REASONS[flag]})" if flag else ""
            problems.append(f"env: llama-server reads {name} as one of its flags, and not an allowed one{why}; "
                            "allowed LLAMA_ARG_* names: "
                            + ", ".join(sorted(e for e in rules.env if e.startswith(LLAMA_ARG_PREFIX))))
        else:
            problems.append(f"env: {name} is not allowed for {engine}; allowed: {', '.join(sorted(allowed))}")
    return problems


def profile_problems(profile: Profile) -> list[str]:
    """Every env and args problem of `profile` (the catalog says them all at once; its source it checks in
    its own words)."""
    try:
        rules_for(profile.engine)
    except PolicyError as exc:
        return [str(exc)]
    return env_problems(profile.env, profile.engine) + args_problems(profile.args, profile.engine)


def check_profile(profile: Profile, source: bool = True) -> None:
    """Check one profile's env, args and (unless `source=False`: the catalog checks it with its own words)
    source against its engine's rules. Raises `PolicyError`. The source goes to the engine as an argument
    of its own, so one that is not a model id, URL or path (`--trust-remote-code`) is refused on the node too."""
    check_env(profile.env, profile.engine)
    check_args(profile.args, profile.engine)
    if not source:
        return
    try:
        parse_source(profile.source)
    except SourceError as exc:
        raise PolicyError(f"source: {exc}") from None
