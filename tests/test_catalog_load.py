"""Loading the catalog: field errors named as written, cross-model rules, engine policy, scaling defaults."""

from __future__ import annotations

import re

import pytest

from llmgw.catalog.loader import CatalogError, parse_catalog
from llmgw.catalog.policy import PolicyError, check_args, check_env


def one(**model) -> dict:
    return {"models": [{"name": "m", "profiles": [{"engine": "sim"}], **model}]}


def test_default_dev_catalog_loads():
    from llmgw.catalog.loader import load_catalog
    from llmgw.dev.stack import DEFAULT_CATALOG

    cat = load_catalog(DEFAULT_CATALOG)
    assert [m.name for m in cat.models] == ["smollm2-135m", "sim-small"]
    assert cat.get("sim-small").simulated and not cat.get("smollm2-135m").simulated


def test_unknown_field_is_named_with_the_model():
    with pytest.raises(CatalogError) as e:
        parse_catalog(one(scalling={"min": 1}))
    assert "models[0] (m).scalling: unknown field" in str(e.value)


def test_bad_scaling_says_what_to_write():
    with pytest.raises(CatalogError, match="max .* is below min"):
        parse_catalog(one(scaling={"min": 2, "max": 1}))


def test_no_scaling_stanza_is_off_and_min0_max1_is_on_demand():
    m = parse_catalog(one()).models[0]
    assert m.effective_scaling.off
    m = parse_catalog(one(scaling={"min": 0, "max": 1})).models[0]
    assert m.effective_scaling.on_demand


def test_fallback_typo_stops_the_apply():
    cat = {"models": [{"name": "a", "fallbacks": ["bb"], "profiles": [{"engine": "sim"}]},
                      {"name": "b", "profiles": [{"engine": "sim"}]}]}
    with pytest.raises(CatalogError, match="no model or alias named 'bb'"):
        parse_catalog(cat)


def test_problems_of_shape_and_across_the_catalog_are_listed_in_one_report():
    """A model whose shape is wrong does not hide the other models' cross-catalog problems; it still counts
    as a name (a fallback or guard naming it is not called unknown), and the indices stay the document's."""
    cat = {"models": [
        {"name": "a", "aliases": ["a1"], "scaling": {"mni": 1}, "profiles": [{"engine": "sim"}]},
        {"name": "b", "fallbacks": ["a1", "nope"], "profiles": [{"engine": "sim", "gpus_per_node": 3, "tp": 2}]},
        {"name": "c", "guard": {"model": "a"}, "profiles": [{"engine": "sim"}]},
        {"name": "d", "profiles": [{"engine": "vlm"}]},
        {"name": "b", "profiles": [{"engine": "sim"}]},
    ]}
    with pytest.raises(CatalogError) as e:
        parse_catalog(cat)
    assert e.value.problems == [
        "models[0] (a).scaling.mni: unknown field; did you mean 'min'?",
        "models[3] (d).profiles[0] (default).engine: Input should be 'vllm', 'sglang', 'llamacpp' or 'sim'; "
        "did you mean 'vllm'?",
        "models[4] (b): name 'b' is already used by model 'b'",
        "models[1] (b).fallbacks: no model or alias named 'nope'",
        "models[1] (b).profiles[0] (default).gpus_per_node: is 3 but tp × pp / nodes = 2; remove it (it follows "
        "from tp, pp and nodes)",
    ], e.value.problems


def test_duplicate_names_and_aliases_are_refused():
    cat = {"models": [{"name": "a", "aliases": ["x"], "profiles": [{"engine": "sim"}]},
                      {"name": "x", "profiles": [{"engine": "sim"}]}]}
    with pytest.raises(CatalogError, match="already used"):
        parse_catalog(cat)


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/x.so"}, {"PYTHONSTARTUP": "/x.py"}, {"NCCL_NET_PLUGIN": "x"},
                                 {"CUDA_INJECTION64_PATH": "/x"}, {"LLAMA_ARG_LOG_FILE": "/tmp/x"}])
def test_env_that_runs_code_or_touches_files_is_refused(env):
    with pytest.raises(PolicyError):
        check_env(env, "sim")
    with pytest.raises(CatalogError):
        parse_catalog(one(profiles=[{"engine": "sim", "env": env}]))


def test_tuning_env_is_allowed():
    check_env({"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "VLLM_ATTENTION_BACKEND": "FLASHINFER"}, "vllm")


@pytest.mark.parametrize("args", [["--trust-remote-code"], ["--log-file=/tmp/x"], ["--slot-save-path", "/tmp"],
                                  ["--port", "1"], ["--model", "/etc/passwd"]])
def test_flags_that_load_code_or_are_set_by_the_worker_are_refused(args):
    for engine in ("vllm", "sglang", "llamacpp", "sim"):
        with pytest.raises(PolicyError):
            check_args(args, engine)


def test_ordinary_flags_and_negative_numbers_pass():
    check_args(["--ctx-size", "4096", "--temp", "-1"], "llamacpp")
    check_args(["--max-model-len=8192", "--seed", "-1"], "vllm")


def test_typos_in_fallbacks_guards_and_engine_flags_are_told_the_name_meant():
    cat = {"models": [
        {"name": "smollm2", "endpoints": ["http://e:1"]},
        {"name": "judge", "role": "guard", "endpoints": ["http://e:1"]},
        {"name": "b", "fallbacks": ["smolm2"], "guard": {"model": "juge"}, "endpoints": ["http://e:1"]},
        {"name": "c", "profiles": [{"engine": "llamacpp", "source": "/m.gguf", "args": ["--ctx-sise", "4"]}]},
        {"name": "d", "profiles": [{"engine": "vllm", "source": "org/m", "args": ["--trust-remote-cod"]}]},
    ]}
    with pytest.raises(CatalogError) as e:
        parse_catalog(cat)
    said = "\n".join(e.value.problems)
    assert "fallbacks: no model or alias named 'smolm2'; did you mean 'smollm2'?" in said
    assert "guard.model: no model or alias named 'juge'; did you mean 'judge'?" in said
    assert "--ctx-sise is not an allowed llamacpp flag (did you mean --ctx-size?)" in said
    # A refused flag is never "meant" as an allowed one that looks like it.
    assert "--trust-remote-cod is not an allowed vllm flag. " in said


def test_a_value_of_the_wrong_shape_is_told_what_to_write():
    """`scaling: on` (YAML reads it as true), an empty `models:`, one alias written without a list."""
    with pytest.raises(CatalogError) as e:
        parse_catalog({"models": [{"name": "a", "scaling": True, "aliases": "b", "profiles": [{"engine": "sim"}]}]})
    assert e.value.problems == [
        "models[0] (a).aliases: must be a list (one `- item` a line, or `[a, b]`), not 'b'",
        "models[0] (a).scaling: must be a mapping of fields (min, max, idle_timeout, sleep_after, target_in_flight, "
        "scale_down_delay, load_wait, load_queue), not true (YAML reads on/off, yes/no as true/false); "
        "for example `scaling: {min: 1, max: 1}`",
    ], e.value.problems
    with pytest.raises(CatalogError) as e:
        parse_catalog({"models": None})
    assert e.value.problems[0].startswith("models: must be a list (one `- item` a line, or `[a, b]`), not nothing")


def test_a_yaml_error_names_the_file_line_and_column(tmp_path):
    from llmgw.catalog.loader import load_catalog

    bad = tmp_path / "catalog.yaml"
    bad.write_text("models:\n  - name: a\n    scaling: {min: 1\n")
    with pytest.raises(CatalogError) as e:
        load_catalog(bad)
    [said] = e.value.problems
    assert said.startswith(f"{bad}:4:1: not valid YAML: ") and "<unicode string>" not in said, said


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    # Plain YAML keeps the last: `name: sim-other` under `name: sim-small` renamed the model, and the apply
    # that followed removed sim-small.
    from llmgw.catalog.loader import load_catalog, read_yaml

    f = tmp_path / "dup.yaml"
    f.write_text("models:\n- name: sim-small\n  name: sim-other\n  profiles: [{engine: sim}]\n")
    with pytest.raises(CatalogError) as e:
        load_catalog(f)
    assert f"{f}:3:3: not valid YAML: the key 'name' is written twice in one mapping (first on line 2)" in str(e.value)
    # A merge key may be overridden, as YAML says, and 1 and "1" are different keys.
    assert read_yaml(f, text="a: &x {b: 1}\nd: {<<: *x, b: 2}\ne: {1: x, '1': y}\n") == {
        "a": {"b": 1}, "d": {"b": 2}, "e": {1: "x", "1": "y"}}


def test_a_catalog_that_is_not_utf8_is_one_line(tmp_path):
    from llmgw.catalog.loader import load_catalog

    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00x")
    with pytest.raises(CatalogError) as e:
        load_catalog(f)
    assert e.value.problems == [f"{f}: not UTF-8 text (byte 0 cannot be read); save the catalog as UTF-8"]


@pytest.mark.parametrize("name", ["x/../sim-small", "a//b", "a/", "a/./b", "a\n"])
def test_a_model_name_that_a_url_would_normalise_is_refused(name):
    # `ctl explain x/../sim-small` and GET /v1/models/x/../sim-small reached sim-small.
    with pytest.raises(CatalogError, match="is not allowed"):
        parse_catalog({"models": [{"name": name, "profiles": [{"engine": "sim"}]}]})


@pytest.mark.parametrize("scaling, says", [
    ({"min": True, "max": 1}, "scaling: `min` takes a number, not true"),
    ({"min": 0, "max": 1, "load_wait": float("nan")}, "scaling.load_wait: Input should be a finite number"),
    ({"min": 0, "max": 1, "idle_timeout": float("inf")}, "scaling.idle_timeout: Input should be a finite number"),
])
def test_a_boolean_or_a_number_that_is_not_finite_is_refused(scaling, says):
    # `min: true` had been read as 1, and `load_wait: .nan` was told it should be at least 0.
    with pytest.raises(CatalogError, match=re.escape(says)):
        parse_catalog(one(scaling=scaling))
