"""`device: cpu`: a vLLM (or SGLang, sim) profile that runs on the CPU, placed by host memory on nodes
without GPUs, and checked when the catalog is written. A profile without the field is byte for byte what it
was (its spec hash adopts what runs; older workers, which refuse unknown fields, still read it)."""

from __future__ import annotations

import pytest

from llmgw.catalog import CatalogError, read_catalog
from llmgw.placement.plan import plan_pass
from llmgw.schemas.catalog import Profile
from tests.fleet import model, node, snapshot


def one(profile: dict) -> dict:
    return {"models": [{"name": "m", "scaling": {"min": 1, "max": 1}, "profiles": [profile]}]}


def refused(profile: dict) -> str:
    with pytest.raises(CatalogError) as exc:
        read_catalog(one(profile))
    return str(exc.value)


def test_a_cpu_vllm_profile_needs_no_gpu_and_is_placed_by_memory_on_a_node_without_one():
    p = read_catalog(one({"engine": "vllm", "source": "mirror:smol/", "device": "cpu", "memory_gb": 4,
                          "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}})).catalog.models[0].profiles[0]
    assert p.gpus_per_shard == 0 and p.shard_count == 1
    m = model("m", engine="vllm", source="org/m", device="cpu", memory_gb=6)
    plan = plan_pass(snapshot([m], [node("small", gpus=0, memory_gb=4), node("cpu-box", gpus=0, memory_gb=16)]))
    [placed] = [d for d in plan.decisions if d.kind == "place"]
    assert [s.node_id for s in placed.shards] == ["cpu-box"] and placed.shards[0].gpus == []
    assert any("small: needs 6 GB of host memory" in r for r in placed.refusals), placed.refusals
    # the same profile without `device` asks for a GPU, which neither node has
    gpu = plan_pass(snapshot([model("m", engine="vllm", source="org/m")], [node("cpu-box", gpus=0)]))
    assert not [d for d in gpu.decisions if d.kind == "place"]


def test_cpu_profiles_that_cannot_run_are_refused_naming_the_field_and_what_to_write():
    assert "device: llama.cpp runs on the CPU when gpus_per_node is unset; remove device" in refused(
        {"engine": "llamacpp", "source": "mirror:x.gguf", "device": "cpu", "memory_gb": 2})
    assert "device: a CPU profile runs one process on one node; remove tp, pp and nodes" in refused(
        {"engine": "vllm", "source": "org/m", "device": "cpu", "memory_gb": 4, "tp": 2})
    assert "device: a CPU profile uses no GPU; remove gpus_per_node and gpu_memory_gb" in refused(
        {"engine": "vllm", "source": "org/m", "device": "cpu", "memory_gb": 4, "gpu_memory_gb": 8})
    assert "memory_gb: a CPU profile is placed by host memory" in refused(
        {"engine": "vllm", "source": "org/m", "device": "cpu"})
    assert "leaves no room for the weights beside a KV cache of VLLM_CPU_KVCACHE_SPACE=4" in refused(
        {"engine": "vllm", "source": "org/m", "device": "cpu", "memory_gb": 4, "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}})
    assert "VLLM_CPU_KVCACHE_SPACE: 'lots' is not a number of GiB" in refused(
        {"engine": "vllm", "source": "org/m", "device": "cpu", "memory_gb": 4, "env": {"VLLM_CPU_KVCACHE_SPACE": "lots"}})
    assert "device" in refused({"engine": "vllm", "source": "org/m", "device": "tpu", "memory_gb": 4})


def test_a_profile_without_device_serialises_and_hashes_as_before():
    p = Profile(engine="vllm", source="org/m")
    assert "device" not in p.model_dump_json()
    # the hash a running engine was adopted by, before `device` existed (issue 35)
    assert p.spec_hash() == Profile.model_validate_json(p.model_dump_json()).spec_hash()
    assert p.spec_hash() == "5cc0d0fa35b1113c06c82fe061e445d7"
    cpu = Profile(engine="vllm", source="org/m", device="cpu", memory_gb=4)
    assert '"device":"cpu"' in cpu.model_dump_json() and cpu.spec_hash() != p.spec_hash()
