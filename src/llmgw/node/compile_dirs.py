"""The node's compile caches: one directory per key (engines/compile_cache.py), one writer at a time, bounded.

One writer per key: a shard takes an exclusive `flock` on its key's `.lock` before launch, and its engine
inherits the locked descriptor (`LaunchPlan.keep_fds`), so the lock lives exactly as long as the engine's
process (whatever becomes of the node worker: an adopted engine still holds it) and the kernel drops it when
the engine dies. vLLM writes its compiled artifacts atomically (Inductor's `write_atomic`, a temporary file
renamed for AOT artifacts) but not the index of its compile cache (`vllm_compile_cache.py`, written in place),
and a reader of a half-written index fails its start: so a second shard of a key that starts while the first
one runs gets a scratch directory of its own, `.compile/.scratch/<name>.<shard>` — a copy of the key's
directory once the engine holding it has become ready (`.warm`: its compile was done and written), else
empty — and its artifacts are not kept. Scratch directories are removed once their engine has ended. A key's
directory whose last engine never became ready (it crashed, maybe mid-write, or failed to start) is emptied
before it is handed out again: a torn artifact must not fail every later start of the key.

Bounded: `trim` (run before each compile directory is handed out) removes scratch directories no engine holds
and then, while the compile caches take more than `compile_cache_gb`, the keys' directories used longest
ago (the time of their last hand-out, `.used`), never one an engine holds. `llmgw ctl reclaim` lists each
key's directory with its size and removes (`--collect`) those whose weights the catalog no longer wants
(node/reclaim.py).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.engines.base import EngineError
from llmgw.engines.compile_cache import CompileKey, compile_root, weights_identity

if TYPE_CHECKING:
    from llmgw.node.host import NodeHost
    from llmgw.schemas.payloads import LaunchShardInput

log = logging.getLogger(__name__)
LOCK = ".lock"
WARM = ".warm"  # the last engine handed this directory became ready: its compile was done and written
USED = ".used"  # touched at each hand-out: the age `trim` goes by
KEY_FILE = "key.json"
SCRATCH = ".scratch"


@dataclass
class CompileDir:
    """A compile directory handed to one shard, with its lock held until `release` (after the launch, the
    engine holds its own copy of the descriptor)."""

    path: Path
    key: CompileKey
    fd: int | None
    shared: bool  # the key's own directory; False: a scratch directory (another engine holds the key's)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path/.lock`, or None when another holds it (or `path` went away
    meanwhile: a trim removed it)."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path / LOCK).st_ino:  # removed and made again while we waited
            raise FileNotFoundError(path / LOCK)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def held(path: Path) -> bool:
    """Whether an engine (or a hand-out under way) holds `path`'s lock now."""
    fd = _lock(path)
    if fd is None:
        return (path / LOCK).exists()
    os.close(fd)
    return False


def _write_key(path: Path, key: CompileKey) -> None:
    if (path / KEY_FILE).exists():
        return
    tmp = path / f".{KEY_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(key.to_json(), sort_keys=True))
    os.replace(tmp, path / KEY_FILE)


def _clear(path: Path) -> None:
    for p in path.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def open_compile_dir(cache_dir: Path, key: CompileKey, shard_id: str, limit_bytes: int | None = None) -> CompileDir:
    """The directory for one shard of `key`, locked: the key's own when no engine holds it, else a scratch one
    (see the module's doc). Trims first when `limit_bytes` is given. Raises OSError (a full or read-only disk)."""
    root = compile_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    if limit_bytes is not None:
        trim(cache_dir, limit_bytes)
    path = root / key.name
    for _ in range(3):
        path.mkdir(exist_ok=True)
        fd = _lock(path)
        if fd is not None:
            if (path / WARM).exists():
                (path / WARM).unlink()  # set again when this engine is ready
            else:
                _clear(path)  # the last engine here never became ready: what it left may be half-written
            _write_key(path, key)
            (path / USED).touch()
            return CompileDir(path=path, key=key, fd=fd, shared=True)
        if (path / LOCK).exists():
            break  # held: another engine of this key runs
    scratch = root / SCRATCH / f"{key.name}.{re.sub(r'[^A-Za-z0-9_-]+', '-', shard_id)[:80]}"
    shutil.rmtree(scratch, ignore_errors=True)
    if (path / WARM).exists():
        shutil.copytree(path, scratch, ignore=shutil.ignore_patterns(LOCK, USED), symlinks=True)
    else:
        scratch.mkdir(parents=True)
    fd = _lock(scratch)
    log.info("compile cache %s is in use by another engine: shard %s gets a %s scratch copy", key.name, shard_id,
             "warm" if (path / WARM).exists() else "cold")
    return CompileDir(path=scratch, key=key, fd=fd, shared=False)


def mark_warm(path: str | Path) -> None:
    """A shard using `path` became ready: its compile is done and written (a scratch copy may be taken)."""
    try:
        (Path(path) / WARM).touch()
    except OSError as exc:
        log.warning("could not mark the compile cache %s warm: %s", path, exc)


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def last_used(path: Path) -> float:
    try:
        return (path / USED).stat().st_mtime
    except OSError:
        return 0.0


def remove_if_free(path: Path) -> bool:
    """Remove `path` unless an engine holds it (its lock is taken while it goes). True if removed."""
    fd = _lock(path)
    if fd is None:
        if (path / LOCK).exists() or not path.exists():
            return False
        shutil.rmtree(path, ignore_errors=True)  # no lock file: a directory from a hand-out that died early
        return True
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def key_dirs(cache_dir: Path) -> list[Path]:
    """The keys' directories (not scratch), oldest use first."""
    root = compile_root(cache_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return sorted(dirs, key=last_used)


def trim(cache_dir: Path, limit_bytes: int) -> list[str]:
    """Remove scratch directories no engine holds, then the least recently used keys' directories no engine
    holds while all of them take more than `limit_bytes`. Returns the names removed."""
    removed: list[str] = []
    scratch = compile_root(cache_dir) / SCRATCH
    if scratch.is_dir():
        for p in scratch.iterdir():
            if p.is_dir() and not p.is_symlink() and remove_if_free(p):
                removed.append(f"{SCRATCH}/{p.name}")
    dirs = key_dirs(cache_dir)
    sizes = {p: dir_bytes(p) for p in dirs}
    total = sum(sizes.values())
    for p in dirs:
        if total <= limit_bytes:
            break
        if remove_if_free(p):
            total -= sizes[p]
            removed.append(p.name)
            log.info("compile cache %s removed (unused since %s; the compile caches were over %d MiB)", p.name,
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(last_used(p))), limit_bytes >> 20)
    return removed


def read_key(path: Path) -> dict:
    """A key's directory's components (`key.json`), {} when unreadable."""
    try:
        return json.loads((path / KEY_FILE).read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=1)
def _gpu_names() -> tuple[str, ...]:
    from llmgw.node.discovery import discover_gpus

    gpus, _ = discover_gpus()
    return tuple(g.name for g in gpus)


def accelerator_kind(gpus: list[int]) -> str:
    """"cpu" for a shard without GPUs, else the model name(s) of its GPUs (NVML), "gpu" when NVML cannot say
    (a simulated node)."""
    if not gpus:
        return "cpu"
    names = _gpu_names()
    kinds = sorted({names[i] for i in gpus if 0 <= i < len(names)})
    return "+".join(kinds) if kinds else "gpu"


async def compile_dir_for(host: "NodeHost", inp: "LaunchShardInput") -> CompileDir | None:
    """The compile directory for launching shard `inp` on `host`'s node, locked; None for a shard already
    running (a retried launch adopts it), an engine without a compile cache, caches off (`compile_cache_gb:
    0`), or a disk that refuses it (the shard then starts with its engine's default, said in the log)."""
    existing = host.supervisor.get(inp.shard_id)
    if existing is not None and host.supervisor.poll(existing) is None:
        return None
    try:
        adapter = host.engines.get(inp.profile.engine)
    except EngineError:
        return None  # the launch refuses it, with its reason
    limit_gb = host.compile_cache_gb
    if limit_gb <= 0 or not adapter.compile_env(str(host.cache_dir)):
        return None

    def hand_out() -> CompileDir:  # runs the engine's Python once (its version), may copy a directory
        key = CompileKey(engine=adapter.name, engine_version=adapter.engine_version(),
                         weights=weights_identity(host.cache_dir, inp.weights_path), tp=inp.profile.tp,
                         pp=inp.profile.pp, accelerator=accelerator_kind(inp.gpus))
        return open_compile_dir(host.cache_dir, key, inp.shard_id, int(limit_gb * (1 << 30)))

    try:
        return await asyncio.to_thread(hand_out)
    except OSError as exc:
        log.warning("shard %s starts without a compile cache: %s", inp.shard_id, exc)
        return None
