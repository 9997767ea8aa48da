"""Engine policy as an allowlist per engine (issue 11): every input that got through the old refusal list is
refused, read the way the engine's own parser reads it; what the docs show still passes; the node worker's
flags and environment win over a profile's; llama-server's allowlist names flags and variables the
installed binary really has. The same check through the real admin API is in test_control_plane.py, and
on the node (a start workflow carrying what the catalog refuses) in test_node_policy.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from llmgw.catalog import CatalogError, read_catalog
from llmgw.catalog.policy import LLAMACPP_FLAGS, RULES, PolicyError, check_args, check_env
from llmgw.engines.base import EngineError, ShardSpec
from llmgw.engines.llamacpp import LlamaCppAdapter, find_llama_server
from llmgw.engines.sglang import SglangAdapter
from llmgw.engines.sim import SimAdapter
from llmgw.engines.vllm import VllmAdapter
from llmgw.schemas.catalog import Profile

REPO = Path(__file__).resolve().parent.parent
ENGINES = sorted(RULES)


def refused(profile: dict) -> str:
    with pytest.raises(CatalogError) as e:
        read_catalog({"models": [{"name": "m", "profiles": [profile]}]})
    return str(e.value)


def source(engine: str) -> dict:
    return {"vllm": {"source": "org/m"}, "sglang": {"source": "org/m"},
            "llamacpp": {"source": "mirror:m.gguf"}}.get(engine, {})


# ---- what got through the refusal list ----------------------------------------------------------

@pytest.mark.parametrize("engine, args, says", [
    ("vllm", ["--trust_remote_code"], "vllm reads '--trust_remote_code' as --trust-remote-code"),
    ("vllm", ["--trust-remote"], "--trust-remote is not an allowed vllm flag"),
    ("sglang", ["--trust-remote"], "--trust-remote is not an allowed sglang flag"),
    ("vllm", ["--hos", "0.0.0.0"], "--hos is not an allowed vllm flag"),
    ("sglang", ["--hos", "0.0.0.0"], "--hos is not an allowed sglang flag"),
    ("sim", ["--hos", "0.0.0.0"], "--hos is not an allowed sim flag"),
    ("llamacpp", ["--rpc", "10.0.0.9:50052"], "llama-server would send activations, and so prompts, to another"),
    ("llamacpp", ["--rpc_", "10.0.0.9:50052"], "llamacpp reads '--rpc_' as --rpc-"),
    ("llamacpp", ["--model-url", "https://example.com/x.gguf"], "--model-url is not an allowed llamacpp flag"),
    ("llamacpp", ["--model_url", "https://example.com/x.gguf"], "reads '--model_url' as --model-url"),
    ("vllm", ["--config", "/tmp/x.yaml"], "not from a file on the node"),
    ("vllm", ["--compilation-config.inductor_passes", "x"], "dotted JSON arguments are not accepted"),
    ("vllm", ["--served_model_name", "x"], "--served-model-name is set by the node worker"),
    ("vllm", ["--", "--trust-remote-code"], "a bare `--`"),
    ("llamacpp", ["-c", "4096"], "write the long form (--ctx-size)"),
    ("llamacpp", ["-np", "4"], "write the long form (--parallel)"),
    ("vllm", ["-q", "awq"], "write the long form (--quantization)"),
    ("sglang", ["-x", "1"], "write the long form (--name)"),
    ("llamacpp", ["--ctx-size=4096"], "does not read --flag=value"),
    ("sglang", ["--enable-custom-logit-processor"], "clients could send code"),
    # A number that is not one: llama-server read `4O96` as 4, and `two` made it exit at every start.
    ("llamacpp", ["--ctx-size", "4O96", "--parallel", "2"], "--ctx-size takes an integer, not '4O96'"),
    ("llamacpp", ["--parallel", "two"], "--parallel takes an integer, not 'two'"),
    ("llamacpp", ["--ctx-size", "--parallel", "2"], "--ctx-size takes an integer; write it as the next item"),
    ("llamacpp", ["--threads"], "--threads takes an integer; write it as the next item"),
    ("llamacpp", ["--temp", "warm"], "--temp takes a number, not 'warm'"),
    ("vllm", ["--max-model-len=lots"], "--max-model-len takes an integer (or 32k, 32K, -1, auto), not 'lots'"),
    ("vllm", ["--gpu-memory-utilization", "90%"], "--gpu-memory-utilization takes a number, not '90%'"),
    ("sglang", ["--context-length", "8k"], "--context-length takes an integer, not '8k'"),
    ("sim", ["--tokens-per-second", "fast"], "--tokens-per-second takes a number, not 'fast'"),
    # A context no model has: llama-server grew to 10 GB holding the KV cache of `--ctx-size 999999999`.
    ("llamacpp", ["--ctx-size", "999999999"], "--ctx-size is a context length in tokens, from 0 to 16777216"),
    ("llamacpp", ["--ctx-size", "-4096"], "not -4096; 0 takes the model's own"),
    ("vllm", ["--max-model-len", "1g"], "--max-model-len is a context length in tokens, from -1 to 16777216"),
    ("vllm", ["--max-model-len", "17M"], "not 17M; -1 or auto takes the model's own"),
    ("sglang", ["--context-length", "0"], "--context-length is a context length in tokens, from 1 to 16777216"),
    # More than a C int: llama-server's `std::stoi` throws, and it exits at every start.
    ("llamacpp", ["--parallel", "4294967296"], "--parallel takes an integer from -2147483648 to 2147483647"),
    ("llamacpp", ["--seed", "4294967296"], "--seed takes an integer from -1 to 4294967295"),
    # A pull request's ref, which anyone may open on a public repository: a stranger's weights under our name.
    ("vllm", ["--revision", "refs/pr/1"], "--revision 'refs/pr/1' is a pull request of the repository"),
    ("vllm", ["--tokenizer-revision=refs/pr/7"], "--tokenizer-revision 'refs/pr/7' is a pull request"),
    ("sglang", ["--revision", "REFS/PR/2"], "is a pull request of the repository, which anyone may open"),
    ("vllm", ["--revision"], "--revision takes a revision (a branch, a tag or a commit sha); write it as the next item"),
])
def test_what_got_through_is_refused_at_apply_naming_the_flag_and_what_is_allowed(engine, args, says):
    with pytest.raises(PolicyError, match=re.escape(says)):
        check_args(args, engine)
    msg = refused({"engine": engine, **source(engine), "args": args})
    assert "models[0] (m).profiles[0] (default): args:" in msg and says in msg
    if "is not an allowed" in says:
        assert f"Allowed {engine} flags: " in msg


@pytest.mark.parametrize("engine, env, says", [
    ("llamacpp", {"LLAMA_ARG_RPC": "10.0.0.9:50052"}, "reads LLAMA_ARG_RPC as one of its flags"),
    ("llamacpp", {"LLAMA_ARG_MODEL_URL": "https://example.com/x.gguf"}, "--model-url"),
    ("llamacpp", {"LLAMA_ARG_CTX_SIZE": "4k"}, "LLAMA_ARG_CTX_SIZE (llama-server's --ctx-size takes an integer, not '4k')"),
    ("llamacpp", {"LLAMA_ARG_CTX_SIZE": "999999999"}, "LLAMA_ARG_CTX_SIZE (llama-server's --ctx-size is a context length"),
    ("llamacpp", {"LLAMA_ARG_HOST": "0.0.0.0"}, "LLAMA_ARG_HOST"),
    *[(e, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "CUDA_VISIBLE_DEVICES is set by the node worker") for e in ENGINES],
    ("vllm", {"VLLM_API_KEY": "x"}, "set by the node worker"),
    ("vllm", {"NCCL_SOCKET_IFNAME": "eth0"}, "set by the node worker"),
    ("vllm", {"NCCL_NET_PLUGIN": "x"}, "NCCL_NET_PLUGIN is not allowed for vllm"),
    ("vllm", {"NCCL_TOPO_FILE": "/etc/x"}, "NCCL_TOPO_FILE is not allowed"),
    ("vllm", {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, "set by the node worker"),  # (for `max_loras`)
    ("sim", {"VLLM_ATTENTION_BACKEND": "FLASHINFER"}, "not allowed for sim"),
    ("sim", {"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD is not allowed"),
])
def test_env_outside_the_engines_allowlist_is_refused_at_apply(engine, env, says):
    with pytest.raises(PolicyError, match=re.escape(says)):
        check_env(env, engine)
    assert says in refused({"engine": engine, **source(engine), "env": env})


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
@pytest.mark.parametrize("src", ["--trust-remote-code", "-m", "org/m --trust-remote-code", "org/-m", "org/m/x",
                                 "ｏrg/m", "org/m\n", "-"])
def test_a_source_the_engine_would_read_as_a_flag_or_not_a_model_is_refused_at_apply(engine, src):
    # vLLM takes the model as its positional argument: a source of `--trust-remote-code` with args
    # `--enforce-eager evil/x` would reach `vllm serve --trust-remote-code --enforce-eager evil/x`.
    msg = refused({"engine": engine, "source": src, "args": ["--enforce-eager", "evil/x"] if engine == "vllm" else []})
    assert f"profiles[0] (default).source: source {src!r}" in msg and "write a hub model id such as" in msg, msg
    assert msg.count("source " + repr(src)) == 1  # said once, in the catalog's words


@pytest.mark.parametrize("adapter", [VllmAdapter("vllm", "ray"), SglangAdapter("python"), LlamaCppAdapter("/bin/true")],
                         ids=lambda a: a.name)
def test_an_adapter_never_passes_weights_that_begin_with_a_dash(adapter):
    # A profile built in code, not through the catalog or the node's checks: the adapter is the last gate.
    p = Profile(engine=adapter.name, source="--trust-remote-code")
    with pytest.raises(EngineError, match="begin with '-', which the engine would read as a flag"):
        adapter.build(_spec(p))


def test_tuning_that_the_engines_parse_the_same_way_passes():
    check_args(["--max_model_len", "8192", "--gpu-memory-utilization=0.9", "--enable-prefix-caching"], "vllm")
    check_args(["--max-model-len", "32k", "--max-num-batched-tokens", "16K", "--seed", "-1"], "vllm")
    check_args(["--ctx_size", "4096", "--parallel", "2", "--temp", "-1", "--top-p", "0.9"], "llamacpp")
    check_args(["--mem-fraction-static=0.8", "--context-length", "32768"], "sglang")
    # The context flags at their bounds: the model's own, and 2**24 tokens (above any model's 10M).
    check_args(["--ctx-size", "0", "--seed", "4294967295"], "llamacpp")
    check_args(["--ctx-size", "16777216", "--seed", "-1"], "llamacpp")
    check_args(["--max-model-len", "-1"], "vllm")
    check_args(["--max-model-len", "auto"], "vllm")
    check_args(["--max-model-len", "16M"], "vllm")
    check_args(["--context-length", "10000000"], "sglang")
    check_args(["--revision", "main", "--tokenizer-revision", "v1.2"], "vllm")
    check_args(["--revision", "0123456789abcdef0123456789abcdef01234567"], "sglang")
    check_args(["--tokens-per-second", "0", "--startup-delay", "-.5"], "sim")
    check_env({"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "VLLM_ATTENTION_BACKEND": "FLASHINFER"}, "vllm")
    check_env({"LLAMA_ARG_CTX_SIZE": "4096", "OMP_NUM_THREADS": "2"}, "llamacpp")


def _yaml_blocks(path: Path) -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)
    return [d for d in (yaml.safe_load(b) for b in blocks) if isinstance(d, dict) and "models" in d]


def test_the_default_catalog_and_the_docs_examples_pass():
    from llmgw.dev.stack import DEFAULT_CATALOG

    read_catalog(yaml.safe_load(Path(DEFAULT_CATALOG).read_text()))
    examples = _yaml_blocks(REPO / "docs" / "catalog.md")
    assert examples, "docs/catalog.md has no catalog example"
    for doc in examples:
        read_catalog(doc)


# ---- the node worker's flags and environment win ----------------------------------------------

def _spec(profile: Profile, gpus=(0, 1)) -> ShardSpec:
    return ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=profile, gpus=list(gpus),
                     weights_path=profile.source or "/cache/m.gguf", host="10.0.0.1", port=8000, api_key="k" * 43)


KEY_VARIABLE = {"vllm": "VLLM_API_KEY", "llamacpp": "LLAMA_API_KEY", "sim": "LLMGW_SIM_API_KEY"}


@pytest.mark.parametrize("adapter", [VllmAdapter("vllm", "ray"), SglangAdapter("python"), SimAdapter(),
                                     LlamaCppAdapter("/bin/true")], ids=lambda a: a.name)
def test_the_workers_env_and_flags_win_over_a_profile_that_skipped_the_policy(adapter):
    # A profile built in code, not through the catalog: the adapters must not let it win either.
    engine = adapter.name
    p = Profile(engine=engine, source="org/m" if engine in ("vllm", "sglang") else None,
                args=["--host", "0.0.0.0", "--port", "1", "--api-key", "mine"],
                env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", KEY_VARIABLE.get(engine, "X"): "mine"})
    plan = adapter.build(_spec(p))
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    argv = plan.argv

    def last(flag: str) -> str:  # argparse and llama.cpp both take a flag's last occurrence
        return argv[max(i for i, a in enumerate(argv) if a == flag) + 1]
    assert last("--host") == "10.0.0.1" and last("--port") == "8000"
    if engine in KEY_VARIABLE:
        assert plan.env[KEY_VARIABLE[engine]] == "k" * 43
        assert "k" * 43 not in argv  # in the environment, not in the process list
    else:
        assert last("--api-key") == "k" * 43  # SGLang reads no variable


# ---- llama-server's allowlist against the installed binary --------------------------------------

def _llama_help() -> dict[str, str | None]:
    binary = find_llama_server()
    if binary is None:
        pytest.skip("llama-server is not installed (scripts/setup builds it)")
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    flags: dict[str, str | None] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("-"):  # "-c,    --ctx-size N    size of ...": flags, value hints, then words
            current = []
            for tok in re.split(r"[\s,]+", line.strip()):
                if re.fullmatch(r"--?[A-Za-z][\w-]*", tok):
                    current.append(tok)
                elif tok[:1].islower():
                    break
            for f in current:
                flags.setdefault(f, None)
        m = re.search(r"\(env: (\w+)\)", line)
        if m:
            for f in current:
                flags[f] = m.group(1)
    return flags


def test_llamacpp_allowlist_names_real_flags_and_their_variables():
    have = _llama_help()
    for flag, env in LLAMACPP_FLAGS.items():
        assert flag in have, f"llama-server has no {flag}"
        assert have[flag] == env, f"{flag}: llama-server reads {have[flag]}, the allowlist says {env}"
    assert have["--rpc"] == "LLAMA_ARG_RPC" and have["--api-key"] == "LLAMA_API_KEY"


def test_docs_list_every_allowed_flag_and_variable():
    text = (REPO / "docs" / "catalog.md").read_text()
    section = text[text.index("### Engine flags and environment"):text.index("### Sources")]
    for rules in RULES.values():
        for name in (*rules.flags, *(e for e in rules.env if not e.startswith("LLAMA_ARG_"))):
            assert f"`{name}`" in section, f"docs/catalog.md does not list {name} ({rules.engine})"
    from llmgw.catalog.policy import COMMON_ENV, WORKER_ENV
    for name in (*COMMON_ENV, *WORKER_ENV):
        assert f"`{name}`" in section, f"docs/catalog.md does not list {name}"
