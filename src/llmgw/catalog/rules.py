"""Per-profile rules checked when a catalog is written: node/GPU/TP arithmetic and the source's form.

Seeds 003 ("Phase 3 (2/3): catalog and reconciler"): a profile that can never be placed must fail when it
is written, not minutes into a load. Without the fleet at hand that is arithmetic: the GPUs a replica
needs must split evenly over its nodes, fit on a node at all, and match the engine's way of using GPUs.
"""

from __future__ import annotations

from llmgw.schemas.catalog import Profile
from llmgw.weights.naming import SourceError, parse_source

# The most GPUs a node of any current design carries (8 on HGX/DGX boards, 16 on a few). A profile that
# needs more on one node can never be placed: raise `nodes` instead.
MAX_GPUS_PER_NODE = 16


def check_arithmetic(p: Profile, where: str) -> list[str]:
    """Problems with `p`'s tp/pp/nodes/gpus_per_node/gpu_memory_gb, each naming its field under `where`."""
    problems: list[str] = []
    if p.device == "cpu":
        if p.engine == "llamacpp":
            problems.append(f"{where}.device: llama.cpp runs on the CPU when gpus_per_node is unset; remove device")
        if p.tp * p.pp != 1 or p.nodes != 1:
            problems.append(f"{where}.device: a CPU profile runs one process on one node; remove tp, pp and nodes")
        if p.gpus_per_node or p.gpu_memory_gb:
            problems.append(f"{where}.device: a CPU profile uses no GPU; remove gpus_per_node and gpu_memory_gb")
        if not p.memory_gb:
            problems.append(f"{where}.memory_gb: a CPU profile is placed by host memory; write the GiB its weights "
                            "and KV cache take (for vLLM: the weights plus VLLM_CPU_KVCACHE_SPACE)")
        kv = p.env.get("VLLM_CPU_KVCACHE_SPACE")
        if p.engine == "vllm" and kv is not None and p.memory_gb:
            try:
                if float(kv) >= p.memory_gb:
                    problems.append(f"{where}.memory_gb: {p.memory_gb} GiB leaves no room for the weights beside a "
                                    f"KV cache of VLLM_CPU_KVCACHE_SPACE={kv} GiB; raise memory_gb")
            except ValueError:
                problems.append(f"{where}.env.VLLM_CPU_KVCACHE_SPACE: {kv!r} is not a number of GiB")
        return problems
    if p.engine == "llamacpp":
        # The upgrade step repairs or refuses these on the written document; this catches a profile
        # built some other way (an API client sending a validated object).
        for key in ("tp", "pp", "nodes"):
            if getattr(p, key) != 1:
                problems.append(f"{where}.{key}: llama.cpp runs one process on one node; write gpus_per_node: N "
                                f"for N GPUs and remove {key}")
    if p.tensor_parallel:
        total = p.tp * p.pp
        if total % p.nodes:
            problems.append(f"{where}.nodes: tp × pp = {total} GPUs do not split evenly over {p.nodes} nodes; "
                            "make tp × pp a multiple of nodes")
            return problems
        per = total // p.nodes
        if p.gpus_per_node is not None and p.gpus_per_node != per:
            problems.append(f"{where}.gpus_per_node: is {p.gpus_per_node} but tp × pp / nodes = {per}; remove it "
                            "(it follows from tp, pp and nodes)")
        if per > MAX_GPUS_PER_NODE:
            problems.append(f"{where}.tp: needs {per} GPUs on each node and no node has more than "
                            f"{MAX_GPUS_PER_NODE}; spread the replica over more nodes")
    else:
        if p.nodes > 1:
            problems.append(f"{where}.nodes: a replica spans nodes only with tensor or pipeline parallelism; "
                            f"set tp × pp to a multiple of nodes ({p.nodes})")
        if (p.gpus_per_node or 0) > MAX_GPUS_PER_NODE:
            problems.append(f"{where}.gpus_per_node: {p.gpus_per_node} is more GPUs than any node has "
                            f"(at most {MAX_GPUS_PER_NODE})")
    if p.gpus_per_shard == 0 and p.gpu_memory_gb:
        problems.append(f"{where}.gpu_memory_gb: is set but the profile uses no GPU; set gpus_per_node to use "
                        "GPUs, or write memory_gb for host memory")
    return problems


def check_source(p: Profile, where: str) -> list[str]:
    """The source parses, and an engine that loads a file has one."""
    try:
        src = parse_source(p.source)
    except SourceError as exc:
        return [f"{where}.source: {exc}"]
    if p.engine == "llamacpp" and src.kind in ("none", "model_id"):
        what = "no source" if src.kind == "none" else f"the model id {p.source!r}"
        return [f"{where}.source: llama.cpp loads a GGUF file and has {what}; write mirror:FILE.gguf, "
                "an http(s) URL of the file, or a path on the node"]
    if p.engine in ("vllm", "sglang") and src.kind == "none":
        return [f"{where}.source: {p.engine} needs a source (a model id such as Qwen/Qwen2.5-7B-Instruct, "
                "a mirror: version, or a path on the node)"]
    return []


def apply_warnings(catalog, removed: list[str] | None = None) -> list[str]:
    """What a catalog says that its writer may not mean, told at apply and refused nowhere: a file with no
    models removes every model the catalog has (`removed`); a model with profiles and no scaling, or
    `max: 0`, is off (`Model.effective_scaling`) and never runs."""
    out = []
    if not catalog.models and removed:
        listed = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        out.append(f"this catalog has no models: applying it removes all {len(removed)} model(s) of the live "
                   f"catalog ({listed}) and stops every replica they run; to switch a model off instead, keep it "
                   "with `scaling: {min: 0, max: 0}`")
    for m in catalog.models:
        if m.profiles and m.effective_scaling.off:
            said = "has no `scaling`" if m.scaling is None else "has scaling max 0"
            out.append(f"{m.name} {said}, so it is off and does not run: write `scaling: {{max: 1}}` to load it "
                       "on demand, or `{min: 1, max: 1}` to keep one replica running")
    return out
