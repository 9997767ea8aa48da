"""Engine policy: profile `env` and `args` may tune an engine, never make it run code or touch files.

From seeds 003 ("Refuse profile env and args that would run code or touch files on the nodes"):
- `env` is an allowlist of tuning families, minus any name that is a path, plugin, library, address or
  credential (`NCCL_NET_PLUGIN`, `CUDA_INJECTION64_PATH` got through an old denylist).
- `args` refuse flags that read, write or load code (`--trust-remote-code`, `--log-file`,
  `--slot-save-path`, ...) and the flags the node worker sets itself (`--host`, `--port`, `--model`).
Checked when the catalog is applied and again on the node before an engine starts.
"""

from __future__ import annotations

import re

from llmgw.schemas.catalog import Profile


class PolicyError(ValueError):
    """A profile asks for env or args the policy refuses; the message says what to write instead."""


ENV_ALLOWED_PREFIXES = (
    "NCCL_", "CUDA_", "VLLM_", "SGLANG_", "OMP_", "MKL_", "TORCH_", "PYTORCH_", "HF_HUB_", "TOKENIZERS_",
    "GGML_", "LLAMA_ARG_", "UCX_", "NVIDIA_", "LLMGW_SIM_",
)
# Names inside an allowed family that still change *what* runs or *where* things are read/written.
ENV_REFUSED_PATTERN = re.compile(
    r"(PATH|PLUGIN|LIB|LIBRARY|INJECTION|PRELOAD|ADDR|ADDRESS|HOST|SOCKET|TOKEN|KEY|SECRET|PASSWORD|"
    r"FILE|DIR|HOME|CONFIG|CACHE|ENDPOINT|URL|MODULE|SCRIPT)"
)
# llama.cpp reads LLAMA_ARG_<FLAG> as --<flag>: checked as the flag it stands for.
LLAMA_ARG_PREFIX = "LLAMA_ARG_"

REFUSED_FLAGS = {
    "--trust-remote-code": "engines may not run code shipped with a model",
    "--log-file": "the node worker captures engine output itself",
    "--slot-save-path": "engines may not write files on the node",
    "--tool-parser-plugin": "engines may not load plugins",
    "--middleware": "engines may not load code",
    "--allowed-local-media-path": "engines may not read arbitrary files",
    "--chat-template-file": "engines may not read arbitrary files; put the template in the model's weights",
    "--lora": "engines may not load files outside the weight cache",
    "--grammar-file": "engines may not read arbitrary files",
    "--download-dir": "weights are fetched by llmgw into its cache",
    "--worker-extension-cls": "engines may not load code",
    "--worker-cls": "engines may not load code",
    "--api-key": "the gateway holds API keys; engines are reached only through it",
    "--ssl-keyfile": "engines may not read arbitrary files",
    "--ssl-certfile": "engines may not read arbitrary files",
    "--path": "llama-server may not serve files from the node",
    "--webui": "engines serve no UI",
    "--mmproj": "engines may not read files outside the weight cache",
}
# Set by the node worker for every engine; a profile that sets them would fight the worker.
WORKER_FLAGS = {"--host", "--port", "--model", "-m", "--alias", "--served-model-name", "--model-path", "--hf-repo", "-hf",
                # where the shards of a multi-node replica meet, and which one this is (the rendezvous)
                "--rank", "--world-size", "--rendezvous", "--token", "--dist-init-addr", "--nnodes", "--node-rank"}


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d+(\.\d+)?", arg):
        return None
    return arg.split("=", 1)[0]


def check_args(args: list[str]) -> None:
    """Raise `PolicyError` for the first refused flag in `args` (argv list, never a shell string)."""
    for arg in args:
        if not isinstance(arg, str):
            raise PolicyError(f"args must be strings, got {arg!r}")
        if "\x00" in arg or "\n" in arg:
            raise PolicyError(f"arg {arg!r} contains a control character")
        flag = _flag_name(arg)
        if flag is None:
            continue
        if flag in REFUSED_FLAGS:
            raise PolicyError(f"args: {flag} is refused ({REFUSED_FLAGS[flag]}); remove it")
        if flag in WORKER_FLAGS:
            raise PolicyError(f"args: {flag} is set by the node worker; remove it (use `source` for the weights)")


def check_env(env: dict[str, str]) -> None:
    """Raise `PolicyError` for the first env name outside the allowlist (see module docstring)."""
    for name, value in env.items():
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            raise PolicyError(f"env: {name!r} is not an upper-case variable name")
        if name.startswith(LLAMA_ARG_PREFIX):
            flag = "--" + name[len(LLAMA_ARG_PREFIX):].lower().replace("_", "-")
            check_args([flag, str(value)])
            continue
        if not name.startswith(ENV_ALLOWED_PREFIXES):
            raise PolicyError(
                f"env: {name} is not allowed; only tuning variables of these families are: "
                + ", ".join(p.rstrip('_') + "_*" for p in ENV_ALLOWED_PREFIXES)
            )
        if ENV_REFUSED_PATTERN.search(name[name.index("_") + 1:]):
            raise PolicyError(f"env: {name} names a path, library, address or credential, which profiles may not set")


def check_profile(profile: Profile) -> None:
    """Check one profile's env and args. Raises `PolicyError`."""
    check_env(profile.env)
    check_args(profile.args)
