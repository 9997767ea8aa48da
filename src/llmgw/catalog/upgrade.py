"""Upgrade repairs: read entries an earlier llmgw accepted the way their authors meant them.

Seeds 003 ("Let the upgrade repair what the field's catalog already holds"): a model written the old way
must be placed after the upgrade, not dropped from the catalog. Two repairs, and refusals that say what to
write instead:

- `tp` on a llama.cpp GPU profile is read as `gpus_per_node` (llama.cpp splits layers across the GPUs of
  one node; `tp` used to be a width nothing placed). A llama.cpp profile is a GPU profile when `tp` > 1 or
  it sets `gpu_memory_gb`. `tp: 1` (and `pp: 1`, `nodes: 1`) mean nothing on llama.cpp and are dropped.
  `pp` > 1, `nodes` > 1, or a `tp` that disagrees with `gpus_per_node` are refused.
- a model-hub repository page (`https://huggingface.co/ORG/NAME`, optionally `/tree/REV`) as the source
  of a vLLM or SGLang profile is read as the repository id `ORG/NAME`, which those engines resolve
  themselves. As a llama.cpp or sim source, where a file is needed, it is refused with the file URL form.

These run on the decoded document, before validation, because only there is it visible whether `tp` was
written at all. They run on `llmgw ctl apply` (the notes are shown with the diff) and again whenever the
stored catalog is read, so a catalog applied by an older control plane is repaired in place too.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

# Hosts whose repository pages are read as repository ids. Only the Hugging Face hub: it is what vLLM and
# SGLang resolve a bare `ORG/NAME` against by default.
HUB_HOSTS = frozenset({"huggingface.co", "www.huggingface.co", "hf.co"})
# First path segments on the hub that are not model repositories.
_HUB_NON_MODEL = frozenset({"datasets", "spaces", "docs", "models", "api", "collections", "organizations",
                            "settings", "blog", "papers", "login", "join", "pricing", "tasks"})


def _where(raw_model: dict, i: int, raw_profile: dict, j: int) -> str:
    """`models[0] (name).profiles[1] (name)`: the same spelling as the loader's rule checks."""
    m = f"models[{i}]" + (f" ({raw_model['name']})" if isinstance(raw_model.get("name"), str) else "")
    name = raw_profile.get("name", "default")
    return f"{m}.profiles[{j}]" + (f" ({name})" if isinstance(name, str) else "")


def hub_repository_id(url: str) -> tuple[str | None, str | None]:
    """`(repository id, revision)` when `url` is a hub repository page, else `(None, None)`.

    `https://huggingface.co/Qwen/Qwen2.5-7B-Instruct` → `("Qwen/Qwen2.5-7B-Instruct", None)`;
    `.../tree/v1.0` → revision `"v1.0"`. File URLs (`/resolve/...`), file pages (`/blob/...`), datasets and
    spaces are not repository pages.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return None, None
    if parts.scheme not in ("http", "https") or parts.hostname not in HUB_HOSTS:
        return None, None
    segs = [s for s in parts.path.split("/") if s]
    if not segs or segs[0] in _HUB_NON_MODEL:
        return None, None
    if len(segs) == 1:
        return segs[0], None
    if len(segs) == 2:
        return f"{segs[0]}/{segs[1]}", None
    if segs[2] == "tree":
        return f"{segs[0]}/{segs[1]}", (segs[3] if len(segs) > 3 else None)
    return None, None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def repair_llamacpp(p: dict, where: str) -> tuple[list[str], list[str]]:
    """Repair or refuse `tp`, `pp`, `nodes` on one llama.cpp profile in place. Returns (notes, problems)."""
    notes: list[str] = []
    problems: list[str] = []
    tp, pp, nodes = p.get("tp"), p.get("pp"), p.get("nodes")
    width = (tp if _is_int(tp) else 1) * (pp if _is_int(pp) else 1)
    if _is_int(nodes) and nodes > 1:
        problems.append(f"{where}.nodes: llama.cpp runs a replica on one node; remove `nodes` "
                        "(use engine vllm or sglang for a replica that spans nodes)")
    if _is_int(pp) and pp > 1:
        problems.append(f"{where}.pp: llama.cpp splits layers across the GPUs of one node by itself; "
                        f"write gpus_per_node: {width} instead of tp and pp")
    if problems:
        return notes, problems
    for key in ("pp", "nodes"):
        if p.get(key) == 1:
            del p[key]
            notes.append(f"{where}.{key}: 1 means nothing on llama.cpp; dropped")
    if "tp" not in p or not _is_int(tp):
        return notes, problems
    g = p.get("gpus_per_node")
    gpu_profile = tp > 1 or bool(p.get("gpu_memory_gb"))
    if g is None and gpu_profile:
        p["gpus_per_node"] = tp
        del p["tp"]
        notes.append(f"{where}.tp: read as gpus_per_node: {tp} (llama.cpp splits layers across that many "
                     "GPUs of one node); write gpus_per_node to silence this")
    elif tp == 1 or tp == g:
        del p["tp"]
        notes.append(f"{where}.tp: {tp} means nothing on llama.cpp; dropped (gpus_per_node sets its GPUs)")
    else:
        problems.append(f"{where}.tp: llama.cpp takes gpus_per_node, not tp, and gpus_per_node is {g}; "
                        "remove tp")
    return notes, problems


def repair_source(p: dict, where: str) -> tuple[list[str], list[str]]:
    """Read a hub repository page as a repository id for vLLM/SGLang; refuse it where a file is needed."""
    src, engine = p.get("source"), p.get("engine")
    if not isinstance(src, str):
        return [], []
    repo, rev = hub_repository_id(src)
    if repo is None:
        return [], []
    if engine in ("vllm", "sglang"):
        p["source"] = repo
        note = f"{where}.source: the repository page {src} is read as the repository id {repo}"
        if rev and rev != "main":
            note += f" (the page named revision {rev}; pin it with args: [--revision, {rev}])"
        return [note], []
    return [], [f"{where}.source: {src} is a repository page, not a file; name the file "
                f"(https://huggingface.co/{repo}/resolve/main/FILE.gguf) or put it in the mirror "
                "(llmgw mirror add URL) and write mirror:FILE"]


def upgrade_model_spec(spec: Any, i: int = 0) -> tuple[Any, list[str], list[str]]:
    """Repair one model as decoded from YAML/JSON (or read from the database). Returns a repaired copy,
    notes (what was repaired, each naming its field) and problems (what cannot be repaired)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("profiles"), list):
        return spec, [], []
    spec = copy.deepcopy(spec)
    notes: list[str] = []
    problems: list[str] = []
    for j, p in enumerate(spec["profiles"]):
        if not isinstance(p, dict):
            continue
        where = _where(spec, i, p, j)
        n, pr = repair_source(p, where)
        notes += n
        problems += pr
        if p.get("engine") == "llamacpp":
            n, pr = repair_llamacpp(p, where)
            notes += n
            problems += pr
    return spec, notes, problems


def upgrade_document(raw: dict) -> tuple[dict, list[str], list[str]]:
    """Repair every model of a decoded catalog `{"models": [...]}`. Returns (copy, notes, problems)."""
    models = raw.get("models")
    if not isinstance(models, list):
        return raw, [], []
    out = dict(raw)
    out["models"] = []
    notes: list[str] = []
    problems: list[str] = []
    for i, m in enumerate(models):
        fixed, n, pr = upgrade_model_spec(m, i)
        out["models"].append(fixed)
        notes += n
        problems += pr
    return out, notes, problems
