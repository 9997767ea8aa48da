"""The engine policy's allowlists against the engines' own parsers (catalog/policy.py), so an engine upgrade
that renames a flag or adds an alias the policy does not expect fails here, not on a node.

- llama-server (`llama-server --help`, the binary the node launches): every allowed flag is one it knows.
- vLLM (its own argument parser, built by the installed package in vLLM's venv): every allowed flag is
  one of its options and reads into no field a worker-set or refused flag sets; the parser reads `_` as `-` and expands
  a prefix, as the policy assumes, and the policy refuses every other option vLLM has, its short aliases
  and a prefix of an allowed flag included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from llmgw.catalog.policy import LLAMACPP, REFUSED_REASONS, VLLM, PolicyError, check_args
from llmgw.engines.llamacpp import find_llama_server
from llmgw.engines.vllm import find_vllm

DUMP = r"""
import json
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser

p = make_arg_parser(FlexibleArgumentParser())
options = {o: a.dest for a in p._actions for o in a.option_strings}

def changed(argv):
    try:
        ns = p.parse_args(argv)
    except SystemExit:
        return None
    return sorted(k for k, v in vars(ns).items() if v != p.get_default(k) and k != "model_tag")

print(json.dumps({"abbrev": p.allow_abbrev, "options": options,
                  "underscore": changed(["m", "--max_model_len", "77"]),
                  "prefix": changed(["m", "--max-model", "77"])}))
"""


def test_every_allowed_llama_server_flag_is_one_llama_server_knows():
    binary = find_llama_server()
    if binary is None:
        pytest.skip("llama-server is not installed (scripts/setup)")
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    known = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", help_text))
    assert len(known) > 100, help_text[:500]
    missing = sorted(f for f in LLAMACPP.flags if f not in known)
    assert missing == [], f"allowed llama.cpp flags llama-server does not know: {missing}"


@pytest.mark.vllm
def test_the_vllm_policy_matches_vllm_s_own_parser():
    exe = find_vllm(None)
    if exe is None:
        if os.environ.get("LLMGW_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is required here (LLMGW_REQUIRE_VLLM=1) but not installed: run scripts/setup --with vllm")
        pytest.skip("vLLM is not installed (scripts/setup --with vllm)")
    out = subprocess.run([str(Path(exe).parent / "python"), "-c", DUMP], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"VLLM_NO_USAGE_STATS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    options: dict[str, str] = parsed["options"]

    missing = sorted(f for f in VLLM.flags if f not in options)
    assert missing == [], f"allowed vLLM flags vLLM does not know: {missing}"
    # no allowed flag reads into a field that a flag the node worker sets, or a refused one, sets (an alias
    # such as --device-memory-utilization for --gpu-memory-utilization shares a harmless field)
    guarded = VLLM.worker_flags | set(REFUSED_REASONS)
    for flag in VLLM.flags:
        clash = sorted(o for o, dest in options.items() if dest == options[flag] and o in guarded)
        assert clash == [], f"{flag} sets {options[flag]!r}, as {clash} do"
    # the parser's ways of reading a flag, which the policy's reading must follow
    assert parsed["underscore"] == ["max_model_len"], "vLLM no longer reads _ as - (EngineRules.underscores)"
    assert parsed["abbrev"] and parsed["prefix"] == ["max_model_len"], "vLLM no longer expands a prefix"
    with pytest.raises(PolicyError):
        check_args(["--max-model", "77"], "vllm")  # a prefix is never expanded by the policy
    # every other option vLLM has, short aliases included, is refused
    let_through = []
    for option in options:
        if option in VLLM.flags:
            continue
        try:
            check_args([option, "1"], "vllm")
        except PolicyError:
            continue
        let_through.append(option)
    assert let_through == [], f"vLLM options the policy lets through without listing them: {let_through}"
