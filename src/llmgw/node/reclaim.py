"""Reclaiming the weight cache on a node: delete only what llmgw fetched and the catalog no longer wants.

The cache name is a hash of the source, so the wanted set is computed from the catalog exactly; anything
without that name was put there by an operator (scp, a shared mount, a copy by hand) and is none of
llmgw's business however unreferenced it looks (seeds 000, "take back only what llmgw put there"). The
node checks every path again itself: a control plane that is wrong, newer, or tampered with must not be
able to talk a node into deleting something. Files a running shard loads are kept.

The engines' compile caches (`.compile/<key>`, node/compile_dirs.py) are listed too, as `.compile/<key>`:
one whose weights are a cache entry the catalog no longer wants is unwanted (its artifacts serve nothing
llmgw will start); one an engine holds is kept. Their size is otherwise bounded by `compile_cache_gb`
(least recently used first) when a shard is launched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmgw.node.compile_dirs import dir_bytes, held, key_dirs, last_used, read_key, remove_if_free
from llmgw.schemas.payloads import CacheEntry, NodeReclaimResult
from llmgw.weights.naming import CACHE_NAME


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return p.stat().st_size


def reclaim(node_id: str, cache_dir: Path, wanted: set[str], in_use: set[str], collect: bool) -> NodeReclaimResult:
    """List (and with `collect`, delete) cache entries llmgw fetched that are not in `wanted`."""
    out = NodeReclaimResult(node_id=node_id)
    root = cache_dir.resolve()
    if not root.is_dir():
        return out
    # The entries running shards load, by name: their weights paths resolved the same way as the entries
    # (a cache directory reached through a symlink is named through it by the fetcher), a file inside a
    # version directory naming the directory.
    used: set[str] = set()
    for p in in_use:
        try:
            rel = Path(p).resolve().relative_to(root)
        except ValueError:
            continue
        if rel.parts:
            used.add(rel.parts[0])
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name.startswith("."):
            continue  # .partial: downloads in progress
        if not CACHE_NAME.match(name) or entry.is_symlink():
            out.ignored.append(name)
            continue
        path = entry.resolve()
        if path.parent != root:  # never follow anything out of the cache
            out.ignored.append(name)
            continue
        if name in wanted:
            continue
        size = _size(path)
        out.entries.append(CacheEntry(name=name, bytes=size, modified_at=path.stat().st_mtime))
        if name in used or name in in_use:
            out.kept_in_use.append(name)
            continue
        out.unwanted.append(name)
        if collect:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            out.removed.append(name)
            out.freed_mb += size // (1 << 20)
    _reclaim_compile_dirs(out, cache_dir, wanted, collect)
    return out


def _reclaim_compile_dirs(out: NodeReclaimResult, cache_dir: Path, wanted: set[str], collect: bool) -> None:
    """List (and with `collect`, delete) the compile caches of weights no longer wanted (module doc)."""
    for path in key_dirs(cache_dir):
        weights = str(read_key(path).get("weights", ""))
        if not CACHE_NAME.match(weights) or weights in wanted:
            continue  # weights that are not llmgw's to judge (a model id, an operator's path), or still wanted
        name = f"{path.parent.name}/{path.name}"
        size = dir_bytes(path)
        out.entries.append(CacheEntry(name=name, bytes=size, modified_at=last_used(path)))
        if held(path):
            out.kept_in_use.append(name)
            continue
        out.unwanted.append(name)
        if collect and remove_if_free(path):
            out.removed.append(name)
            out.freed_mb += size // (1 << 20)
