"""Fetch weights into the node's cache: single-flight per source, resumable, verified, atomic.

- The cache file is named by `cache_name_for(source)`, so what llmgw fetched is computable from the catalog.
- Eight shards asking for one source at once produce one download (single flight).
- An interrupted download resumes with an HTTP Range request from `<cache>/.partial/<name>`.
- The file is written beside its target and renamed only when complete and verified (size, and sha256 when
  the server states it): a partial file under the model's name would be found, reported present and
  handed to an engine that fails on it (seeds 000).
- A version (source ending in `/`) is fetched from its manifest, every file into one directory, which is
  renamed into place only when every file is complete.
- Hashing a whole file (a resumed partial, a version's files already present) runs in a thread: the node
  worker's event loop also carries its heartbeats and activity heartbeats, and hashing 100 GB takes
  minutes (issue 9).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote

import aiohttp

from llmgw.weights.naming import Source, SourceError, cache_name_for, parse_source

log = logging.getLogger(__name__)
CHUNK = 1 << 20
SHA_HEADER = "X-Llmgw-Sha256"

Progress = Callable[[int, int | None], None]  # (bytes so far, total or None)


class FetchError(RuntimeError):
    """A fetch that cannot succeed as asked (bad source, missing file, checksum mismatch)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Fetched:
    path: str | None
    bytes: int = 0
    fetched: bool = False


class Fetcher:
    """Fetches sources into `cache_dir`. One per node worker; safe to call concurrently."""

    def __init__(self, cache_dir: Path, mirror_url: str | None):
        self.cache_dir = cache_dir
        self.partial_dir = cache_dir / ".partial"
        self.mirror_url = mirror_url
        self._inflight: dict[str, asyncio.Future] = {}
        self._listeners: dict[str, list[Progress]] = {}
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.partial_dir.mkdir(parents=True, exist_ok=True)

    def cached_names(self) -> list[str]:
        """Cache names present and complete (what placement may treat as already held)."""
        return sorted(p.name for p in self.cache_dir.iterdir() if not p.name.startswith("."))

    async def fetch(self, source: str | None, progress: Progress | None = None) -> Fetched:
        """Make `source` available on this node and return what the engine should load."""
        try:
            src = parse_source(source, self.mirror_url)
        except SourceError as exc:
            raise FetchError(str(exc), retryable=False) from None
        if src.kind == "none":
            return Fetched(None)
        if src.kind == "model_id":
            return Fetched(src.raw)  # vLLM/SGLang resolve a bare id themselves
        if src.kind == "path":
            path = Path(src.raw)  # type: ignore[arg-type]
            if not path.exists():
                raise FetchError(f"source {src.raw} does not exist on this node", retryable=False)
            return Fetched(str(path.resolve()))
        if not src.url:
            raise FetchError(f"source {source} needs a mirror URL; set LLMGW_MIRROR_URL", retryable=False)
        name = cache_name_for(src.raw)  # type: ignore[arg-type]
        target = self.cache_dir / name
        if target.exists():
            return Fetched(str(target), _size(target), fetched=False)
        listeners = self._listeners.setdefault(name, [])
        if progress:
            listeners.append(progress)
        task = self._inflight.get(name)
        if task is None:
            def fan_out(n: int, total: int | None) -> None:
                for cb in list(self._listeners.get(name, [])):
                    cb(n, total)

            task = asyncio.ensure_future(self._download(src, target, fan_out))
            self._inflight[name] = task

            def done(_t: asyncio.Future) -> None:
                self._inflight.pop(name, None)
                self._listeners.pop(name, None)

            task.add_done_callback(done)
        try:
            # Shielded: one caller giving up (an activity cancelled) does not cancel the others' download.
            return await asyncio.shield(task)
        finally:
            if progress and progress in self._listeners.get(name, []):
                self._listeners[name].remove(progress)

    async def _download(self, src: Source, target: Path, progress: Progress | None) -> Fetched:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if src.is_version:
                total = await self._download_version(session, src.url, target, progress)  # type: ignore[arg-type]
            else:
                partial = self.partial_dir / target.name
                total = await download_file(session, src.url, partial, progress)  # type: ignore[arg-type]
                os.replace(partial, target)
        log.info("fetched %s into %s (%d bytes)", src.raw, target, total)
        return Fetched(str(target), total, fetched=True)

    async def _download_version(self, session: aiohttp.ClientSession, url: str, target: Path, progress: Progress | None) -> int:
        async with session.get(url) as r:
            if r.status != 200:
                raise FetchError(f"manifest {url}: HTTP {r.status}", retryable=r.status >= 500)
            ctype = r.headers.get("Content-Type", "")
            text = await r.text()
        if "json" not in ctype:
            raise FetchError(f"{url} answered {ctype or 'no content type'} where a version manifest (JSON) was expected; "
                             "is this a plain file server rather than an llmgw mirror?", retryable=False)
        manifest = json.loads(text)
        files = manifest.get("files", [])
        work = self.partial_dir / (target.name + ".d")
        work.mkdir(parents=True, exist_ok=True)
        total_size = sum(int(f.get("size", 0)) for f in files) or None
        done = 0
        for f in files:
            fname = str(f["name"])
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise FetchError(f"manifest names file {fname!r}, which is not a plain file name", retryable=False)
            dest = work / fname
            if (dest.exists() and dest.stat().st_size == f.get("size") and f.get("sha256")
                    and await asyncio.to_thread(_sha256, dest) == f["sha256"]):
                done += dest.stat().st_size
                continue
            part = work / (fname + ".part")
            base = done

            def sub(n: int, _t: int | None, base: int = base) -> None:
                if progress:
                    progress(base + n, total_size)

            await download_file(session, url + quote(fname), part, sub, expect_sha=f.get("sha256"), expect_size=f.get("size"))
            os.replace(part, dest)
            done += dest.stat().st_size
        if target.exists():
            shutil.rmtree(work)
        else:
            os.replace(work, target)
        return done


async def download_file(
    session: aiohttp.ClientSession, url: str, partial: Path, progress: Progress | None = None,
    expect_sha: str | None = None, expect_size: int | None = None,
) -> int:
    """Download `url` into `partial`, resuming from its current size. Verifies size and sha256.

    Returns the file's size. Raises `FetchError` (non-retryable for 4xx and checksum mismatches).
    """
    have = partial.stat().st_size if partial.exists() else 0
    hasher = hashlib.sha256()
    if have:
        hasher, have = await asyncio.to_thread(_hash_prefix, partial)
    headers = {"Range": f"bytes={have}-"} if have else {}
    async with session.get(url, headers=headers) as r:
        if r.status == 416 and have:
            total = have  # already complete
        elif r.status in (200, 206):
            if r.status == 200 and have:
                have = 0  # server ignored the Range: start over
                hasher = hashlib.sha256()
            total = None
            if r.status == 206:
                crange = r.headers.get("Content-Range", "")
                total = int(crange.rsplit("/", 1)[-1]) if "/" in crange and not crange.endswith("*") else None
            elif r.content_length is not None:
                total = r.content_length
            expect_sha = expect_sha or r.headers.get(SHA_HEADER)
            with open(partial, "ab" if have else "wb") as out:
                n = have
                async for block in r.content.iter_chunked(CHUNK):
                    out.write(block)
                    hasher.update(block)
                    n += len(block)
                    if progress:
                        progress(n, total)
            if total is not None and n != total:
                raise FetchError(f"{url}: got {n} of {total} bytes")
            total = n
        elif 400 <= r.status < 500:
            raise FetchError(f"{url}: HTTP {r.status}", retryable=False)
        else:
            raise FetchError(f"{url}: HTTP {r.status}")
    if expect_size is not None and total != expect_size:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{url}: size {total} but the manifest says {expect_size}")
    if expect_sha and hasher.hexdigest() != expect_sha:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{url}: sha256 mismatch (got {hasher.hexdigest()}, expected {expect_sha})", retryable=True)
    return total


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def _hash_prefix(path: Path) -> tuple["hashlib._Hash", int]:
    """A sha256 of `path` as it is now, ready to continue, and how many bytes it covers (run in a thread)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
            n += len(block)
    return h, n


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()
