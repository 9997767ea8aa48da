"""Catalog rules: upgrade repairs, arithmetic, fallbacks, errors naming the field.

The same rules through the real admin API and `llmgw ctl apply` are in test_fleet_catalog.py.
"""

from __future__ import annotations

import pytest

from llmgw.catalog import CatalogError, read_catalog
from llmgw.catalog.upgrade import hub_repository_id, upgrade_model_spec


def refused(doc) -> str:
    with pytest.raises(CatalogError) as exc:
        read_catalog(doc)
    return str(exc.value)


def one(profile: dict, **model) -> dict:
    return {"models": [{"name": "m", "scaling": {"min": 1, "max": 1}, "profiles": [profile], **model}]}


def test_tp_on_a_llamacpp_gpu_profile_is_read_as_gpus_per_node():
    got = read_catalog(one({"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 2}))
    p = got.catalog.models[0].profiles[0]
    assert p.gpus_per_node == 2 and p.tp == 1 and p.gpus_per_shard == 2
    assert got.notes == ["models[0] (m).profiles[0] (default).tp: read as gpus_per_node: 2 (llama.cpp splits layers "
                         "across that many GPUs of one node); write gpus_per_node to silence this"]
    # tp: 1 with GPU memory is one GPU; tp: 1 on a CPU profile means nothing and is dropped.
    p = read_catalog(one({"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 1, "gpu_memory_gb": 8})).catalog.models[0].profiles[0]
    assert p.gpus_per_node == 1
    got = read_catalog(one({"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 1, "memory_gb": 2}))
    assert got.catalog.models[0].profiles[0].gpus_per_shard == 0 and "dropped" in got.notes[0]


def test_llamacpp_pp_nodes_and_conflicting_tp_are_refused_with_what_to_write():
    msg = refused(one({"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 2, "pp": 2}))
    assert "profiles[0] (default).pp: llama.cpp splits layers across the GPUs of one node by itself; write gpus_per_node: 4" in msg
    msg = refused(one({"engine": "llamacpp", "source": "mirror:x.gguf", "nodes": 2}))
    assert "profiles[0] (default).nodes: llama.cpp runs a replica on one node; remove `nodes`" in msg
    msg = refused(one({"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 4, "gpus_per_node": 2}))
    assert "profiles[0] (default).tp: llama.cpp takes gpus_per_node, not tp, and gpus_per_node is 2; remove tp" in msg


def test_a_hub_repository_page_as_a_vllm_source_is_read_as_the_repository_id():
    got = read_catalog(one({"engine": "vllm", "source": "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct"}))
    assert got.catalog.models[0].profiles[0].source == "Qwen/Qwen2.5-7B-Instruct"
    assert "read as the repository id Qwen/Qwen2.5-7B-Instruct" in got.notes[0]
    assert hub_repository_id("https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/tree/v2") == ("Qwen/Qwen2.5-7B-Instruct", "v2")
    assert hub_repository_id("https://huggingface.co/Qwen/X/resolve/main/a.gguf") == (None, None)
    assert hub_repository_id("https://huggingface.co/datasets/a/b") == (None, None)
    assert hub_repository_id("https://example.com/Qwen/X") == (None, None)
    # Where a file is needed, the page is refused with the form to write.
    msg = refused(one({"engine": "llamacpp", "source": "https://huggingface.co/org/repo"}))
    assert "source: https://huggingface.co/org/repo is a repository page, not a file" in msg
    assert "https://huggingface.co/org/repo/resolve/main/FILE.gguf" in msg


def test_the_repairs_apply_to_what_is_already_stored():
    stored = {"name": "old", "profiles": [{"engine": "llamacpp", "source": "mirror:x.gguf", "tp": 4}]}
    fixed, notes, problems = upgrade_model_spec(stored)
    assert fixed["profiles"][0] == {"engine": "llamacpp", "source": "mirror:x.gguf", "gpus_per_node": 4}
    assert stored["profiles"][0]["tp"] == 4  # a copy: the caller's document is not changed
    assert notes and not problems


def test_node_gpu_tp_arithmetic_is_checked_at_load():
    msg = refused(one({"engine": "vllm", "source": "org/m", "tp": 3, "nodes": 2}))
    assert "profiles[0] (default).nodes: tp × pp = 3 GPUs do not split evenly over 2 nodes" in msg
    msg = refused(one({"engine": "sglang", "source": "org/m", "tp": 8, "nodes": 2, "gpus_per_node": 8}))
    assert "profiles[0] (default).gpus_per_node: is 8 but tp × pp / nodes = 4" in msg
    msg = refused(one({"engine": "vllm", "source": "org/m", "tp": 32}))
    assert "profiles[0] (default).tp: needs 32 GPUs on each node" in msg
    msg = refused(one({"engine": "sim", "nodes": 2}))
    assert "profiles[0] (default).nodes: a replica spans nodes only with tensor or pipeline parallelism" in msg
    msg = refused(one({"engine": "sim", "gpu_memory_gb": 40}))
    assert "profiles[0] (default).gpu_memory_gb: is set but the profile uses no GPU" in msg
    ok = read_catalog(one({"engine": "sim", "tp": 8, "nodes": 2, "gpu_memory_gb": 40})).catalog.models[0].profiles[0]
    assert ok.gpus_per_shard == 4 and ok.shard_count == 2


def test_sources_are_checked_at_load():
    assert "llama.cpp loads a GGUF file and has no source" in refused(one({"engine": "llamacpp"}))
    assert "only http(s):// and mirror: URLs can be fetched" in refused(one({"engine": "vllm", "source": "s3://b/k"}))


def test_fallbacks_and_aliases_resolve_at_load():
    doc = {"models": [
        {"name": "big", "aliases": ["b"], "fallbacks": ["s", "small"], "profiles": [{"engine": "sim"}]},
        {"name": "small", "aliases": ["s"], "profiles": [{"engine": "sim"}]},
    ]}
    assert read_catalog(doc).catalog.models[0].fallbacks == ["small"]
    doc["models"][0]["fallbacks"] = ["smol"]
    assert "models[0] (big).fallbacks: no model or alias named 'smol'" in refused(doc)
    doc["models"][0]["fallbacks"] = ["b"]
    assert "'b' is the model itself" in refused(doc)


def test_scaling_semantics():
    def scaling(sc):
        return read_catalog(one({"engine": "sim"}, scaling=sc) if sc is not None else
                            {"models": [{"name": "m", "profiles": [{"engine": "sim"}]}]}).catalog.models[0].effective_scaling
    assert scaling({"min": 0, "max": 2}).on_demand
    assert scaling({"min": 0, "max": 0}).off
    assert scaling(None).off  # no stanza: off, never on demand
    assert scaling({"min": 0, "max": 1, "idle_timeout": "5m"}).idle_timeout == 300
    said = refused(one({"engine": "sim"}, scaling={"min": 1, "max": 0}))
    assert "max (0) is below min (1)" in said and "min: 0, max: 0 to switch the model off" in said
    assert "scaling.idle_timeout" in refused(one({"engine": "sim"}, scaling={"max": 1, "idle_timeout": "soon"}))


def test_every_problem_is_reported_at_once_naming_its_field():
    msg = refused({"models": [{"name": "m", "fallbacks": ["nope"], "profiles": [
        {"engine": "llamacpp", "source": "mirror:x.gguf", "pp": 2},
        {"name": "b", "engine": "vllm", "source": "org/m", "tp": 3, "nodes": 2},
        {"name": "c", "engine": "sim", "env": {"LD_PRELOAD": "/x.so"}},
    ]}]})
    for field in ("models[0] (m).profiles[0] (default).pp:", "models[0] (m).fallbacks:",
                  "models[0] (m).profiles[1] (b).nodes:", "models[0] (m).profiles[2] (c): env: LD_PRELOAD"):
        assert field in msg, msg
    assert "models[0] (m).scalling: unknown field" in refused({"models": [{"name": "m", "scalling": {}, "profiles": [{"engine": "sim"}]}]})


def test_a_misspelt_field_or_engine_gets_the_spelling_meant_and_an_unnamed_profile_is_default():
    msg = refused({"models": [{"name": "m", "scalling": {}, "profiles": [{"engine": "sim"}]}]})
    assert "models[0] (m).scalling: unknown field; did you mean 'scaling'?" in msg, msg
    msg = refused({"models": [{"name": "m", "scaling": {"max": 1, "mni": 0}, "profiles": [{"engine": "sim"}]}]})
    assert "models[0] (m).scaling.mni: unknown field; did you mean 'min'?" in msg, msg  # Scaling's own fields
    msg = refused({"models": [{"name": "m", "profiles": [{"engine": "sim", "gpu_memroy_gb": 4}]}]})
    assert "models[0] (m).profiles[0] (default).gpu_memroy_gb: unknown field; did you mean 'gpu_memory_gb'?" in msg
    msg = refused({"models": [{"name": "m", "profiles": [{"engine": "sim", "zzzz": 1}]}]})
    assert "zzzz: unknown field; check its spelling against docs/catalog.md" in msg, msg
    for written, meant in (("vlm", "vllm"), ("LlamaCpp", "llamacpp"), ("sglang2", "sglang")):
        msg = refused({"models": [{"name": "m", "profiles": [{"name": "gpu", "engine": written}]}]})
        assert "models[0] (m).profiles[0] (gpu).engine: Input should be" in msg and f"did you mean {meant!r}?" in msg, msg
    msg = refused({"models": [{"name": "m", "profiles": [{"engine": "tensorrt"}]}]})
    assert "profiles[0] (default).engine: Input should be" in msg and "did you mean" not in msg, msg


def test_rendezvous_flags_are_the_node_workers():
    assert "--rendezvous is set by the node worker" in refused(one({"engine": "sim", "args": ["--rendezvous", "h:1"]}))


def test_a_model_that_is_off_is_said_at_apply_and_only_that_one():
    from llmgw.catalog.rules import apply_warnings

    catalog = read_catalog({"models": [
        {"name": "no-scaling", "profiles": [{"engine": "sim"}]},
        {"name": "max-zero", "scaling": {"min": 0, "max": 0}, "profiles": [{"engine": "sim"}]},
        {"name": "on-demand", "scaling": {"max": 1}, "profiles": [{"engine": "sim"}]},
        {"name": "elsewhere", "endpoints": ["http://10.0.0.5:8000/v1"]},  # routed, not run: never off
    ]}).catalog
    warnings = apply_warnings(catalog)
    assert [w.split(" ")[0] for w in warnings] == ["no-scaling", "max-zero"]
    assert "has no `scaling`" in warnings[0] and "has scaling max 0" in warnings[1]
    assert all("`scaling: {max: 1}`" in w for w in warnings)
