"""Fetch weights into the node's cache: single-flight per source, resumable, verified, atomic.

- The cache file is named by `cache_name_for(source)`, so what llmgw fetched is computable from the catalog.
- Eight shards asking for one source at once produce one download (single flight in the process), and
  an exclusive lock per target keeps two processes on one cache (two agents on a shared disk) from
  writing one file: the second waits, then finds the file there.
- Each file is fetched by `download.download`: resumed with Range from what an earlier attempt left,
  the range checked, hashed while it arrives, verified (size; sha256 from the manifest or the mirror's
  `X-Llmgw-Sha256`), fsynced and renamed into place (seeds 000; issue 11).
- A version (source ending in `/`) is fetched from its manifest, whose every field is checked first
  (`manifest.parse_manifest`): a bad one refuses the version. Every file goes into one directory, which
  is renamed into place only when every file is complete. A mirror answering 409 has the version not
  ready yet (still being mirrored): retried, never taken as a partial set.
- From a peer (issue 39): given `peers` (nodes that hold the same cache entry, named by the control plane
  in its answer to "still wanted?"), each file is fetched from the first peer that serves it, over mutual
  TLS (node/peer_server.py), and verified against the mirror's digest, never the peer's: a version's
  manifest is read from the mirror, a single file's size and sha256 from a `HEAD` there. A peer that fails,
  stalls or serves other bytes is passed over for the next, then the mirror, resuming what arrived (a
  mismatch discards it). A source whose digest the mirror does not state (a plain URL) is never taken from
  a peer.
- Nothing that hashes a whole file runs on the event loop (issue 9): the node worker's loop also carries
  its heartbeats and activity heartbeats, and hashing 100 GB takes minutes. A transfer, resumed partial
  included, runs in its own thread (`download.download`); other file work goes through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.weights.download import SHA_HEADER, Downloaded, FetchError, Limits, Progress, download, target_lock
from llmgw.weights.http import PeerTLS, open_url, read_small
from llmgw.weights.manifest import MAX_JSON_BYTES, SHA256, ManifestError, fsync_dir, parse_manifest, record_sha256, \
    recorded_sha256
from llmgw.weights.naming import Source, SourceError, cache_name_for, parse_source
from llmgw.weights.urls import URLRefused, redact

log = logging.getLogger(__name__)

__all__ = ["FetchError", "Fetched", "Fetcher", "Peer", "Progress"]
PEER_STALL_S = 15.0


@dataclass
class Fetched:
    path: str | None
    bytes: int = 0
    fetched: bool = False
    peer_bytes: int = 0  # of `bytes`, how many came from peers
    peers: tuple[str, ...] = ()  # the peers they came from


@dataclass(frozen=True)
class Peer:
    """A node that holds the entry, and its peer listener's URL (`https://ADDRESS:PORT`)."""

    node_id: str
    url: str


@dataclass
class _Sources:
    """Where this fetch's files come from: the peers to try, in order, and what came from them."""

    peers: list[Peer]
    tls: object | None  # ssl.SSLContext for peers
    peer_bytes: int = 0
    used: list[str] = field(default_factory=list)  # the peers files came from, in order


class Fetcher:
    """Fetches sources into `cache_dir`. One per node worker; safe to call concurrently."""

    def __init__(self, cache_dir: Path, mirror_url: str | None, limits: Limits = Limits(), peer_tls=None):
        """`peer_tls()`: the TLS context for peers (llmgw's CA, this node's certificate), or None: no peers."""
        self.cache_dir = cache_dir
        self.peer_tls = peer_tls
        # A peer is a node next door: one that stalls is given up on sooner than the mirror, which is all
        # there is after it.
        self._peer_limits = dataclasses.replace(limits, stall_s=min(limits.stall_s, PEER_STALL_S))
        self.partial_dir = cache_dir / ".partial"
        self.mirror_url = mirror_url
        self.limits = limits
        self._inflight: dict[str, asyncio.Future] = {}
        self._listeners: dict[str, list[Progress]] = {}
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.partial_dir.mkdir(parents=True, exist_ok=True)

    def cached_names(self) -> list[str]:
        """Cache names present and complete (what placement may treat as already held); none when the
        cache directory is gone (an operator emptied it): it is made again at the next fetch, and the
        agent's heartbeat must not fail meanwhile (it had, every 4 s, until the agent restarted)."""
        try:
            return sorted(p.name for p in self.cache_dir.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def missing_name(self, source: str | None) -> str | None:
        """The cache name `source` is fetched into when it comes over the network and is not in this cache
        yet: what to ask peers for. None for a path, a bare model id, none, a source that does not parse, or
        one held here already."""
        try:
            src = parse_source(source, self.mirror_url)
        except SourceError:
            return None
        if not (src.url and src.raw):
            return None
        name = cache_name_for(src.raw)
        return None if (self.cache_dir / name).exists() else name

    async def fetch(self, source: str | None, progress: Progress | None = None, peers: list[Peer] | None = None) -> Fetched:
        """Make `source` available on this node and return what the engine should load; `peers`: nodes that
        hold it, tried before the mirror (a download already under way goes on from where it takes it)."""
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
        # An operator may empty the cache while the agent runs (`rm -rf` of the directory to free disk):
        # made again here, else every fetch failed on its lock file until the agent restarted.
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        listeners = self._listeners.setdefault(name, [])
        if progress:
            listeners.append(progress)
        task = self._inflight.get(name)
        if task is None:
            def fan_out(n: int, total: int | None) -> None:
                for cb in list(self._listeners.get(name, [])):
                    cb(n, total)

            tls = self.peer_tls() if peers and self.peer_tls else None
            sources = _Sources(list(peers or ()) if tls is not None else [], tls)
            task = asyncio.ensure_future(self._download(src, target, fan_out, sources))
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

    async def _download(self, src: Source, target: Path, progress: Progress, sources: _Sources) -> Fetched:
        async with target_lock(self.partial_dir, target):
            if target.exists():  # another process on this cache fetched it while we waited for the lock
                return Fetched(str(target), _size(target), fetched=False)
            if src.is_version:
                total = await self._download_version(src.url, target, progress, sources)  # type: ignore[arg-type]
            else:
                legacy = self.partial_dir / target.name  # earlier versions' fixed partial: resume from it
                if legacy.is_file():
                    os.replace(legacy, self.partial_dir / f"{target.name}.legacy.part")
                size = sha = None
                if sources.peers:
                    size, sha = await asyncio.to_thread(_head, src.url, self.limits)  # type: ignore[arg-type]
                    if sha is None:
                        log.info("%s states no sha256: not fetched from a peer", redact(src.raw or ""))
                        sources.peers = []
                got = await self._file(src.url, target.name, target, self.partial_dir, size, sha,  # type: ignore[arg-type]
                                       progress, sources)
                total = got.size
                # Recorded, so this node's peer listener serves it without hashing it again.
                await asyncio.to_thread(record_sha256, self.cache_dir, {target.name: got.sha256})
        peers = tuple(dict.fromkeys(sources.used))
        log.info("fetched %s into %s (%d bytes%s)", redact(src.raw or ""), target, total,
                 f", {sources.peer_bytes} from {', '.join(peers)}" if peers else "")
        return Fetched(str(target), total, fetched=True, peer_bytes=sources.peer_bytes, peers=peers)

    async def _file(self, url: str, name: str, dest: Path, work: Path, size: int | None, sha: str | None,
                    progress: Progress, sources: _Sources) -> Downloaded:
        """One file into `dest`: from each peer in turn (`name`: its path in their caches), then from `url`."""
        for peer in list(sources.peers):
            try:
                got = await download(f"{peer.url.rstrip('/')}/files/{name}", dest, work, expect_size=size,
                                     expect_sha=sha, progress=progress, limits=self._peer_limits,
                                     peer=PeerTLS(sources.tls, peer.node_id))  # type: ignore[arg-type]
            except FetchError as exc:
                log.warning("fetching %s from peer %s failed (%s); trying %s", name, peer.node_id, exc,
                            "the next peer" if peer is not sources.peers[-1] else "the mirror")
                sources.peers.remove(peer)  # not asked again in this fetch
                continue
            sources.peer_bytes += got.received
            sources.used.append(peer.node_id)
            return got
        return await download(url, dest, work, expect_size=size, expect_sha=sha, progress=progress, limits=self.limits)

    async def _download_version(self, url: str, target: Path, progress: Progress, sources: _Sources) -> int:
        manifest = parse_manifest_or_refuse(await asyncio.to_thread(_get_manifest, url, self.limits), url)
        too_big = [f.name for f in manifest.files if f.size > self.limits.max_bytes]
        if too_big:
            raise FetchError(f"version {redact(url)}: {too_big[0]} is over the limit of {self.limits.max_bytes} bytes "
                             "(LLMGW_FETCH_MAX_BYTES)", retryable=False)
        work = self.partial_dir / (target.name + ".d")  # ours alone while we hold the target's lock
        work.mkdir(parents=True, exist_ok=True)
        total_size = manifest.size
        done = 0
        for f in manifest.files:
            dest = work / f.name
            if dest.is_file() and dest.stat().st_size == f.size and recorded_sha256(dest) == f.sha256:
                done += f.size  # verified by an earlier attempt
                continue

            def sub(n: int, _t: int | None, base: int = done) -> None:
                progress(base + n, total_size)

            async with target_lock(work, dest):
                got = await self._file(url + f.name, f"{target.name}/{f.name}", dest, work, f.size, f.sha256, sub,
                                       sources)
            await asyncio.to_thread(record_sha256, work, {f.name: got.sha256})
            done += got.size
        for p in work.iterdir():
            if p.name.startswith("."):
                p.unlink()
            elif p.name not in {f.name for f in manifest.files}:
                p.unlink()  # a partial of an attempt that lost the race, a file the manifest no longer names
        os.replace(work, target)
        fsync_dir(self.cache_dir)
        return done


def parse_manifest_or_refuse(raw: bytes, url: str):
    try:
        return parse_manifest(raw)
    except ManifestError as exc:
        raise FetchError(f"version {redact(url)} refused: {exc}", retryable=False) from None


def _get_manifest(url: str, limits: Limits) -> bytes:
    """A version's manifest (blocking; run in a thread). Raises `FetchError`."""
    try:
        opened = open_url(url, None, timeout_s=limits.stall_s)
    except URLRefused as exc:
        raise FetchError(str(exc), retryable=False) from None
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"manifest {redact(url)}: {type(exc).__name__}") from None
    try:
        status, ctype = opened.status, opened.headers.get("Content-Type") or ""
        if status == 409:
            text = opened.response.read(2000).decode(errors="replace")
            raise FetchError(f"version {redact(url)} is not ready yet on the mirror: {text}")
        if status != 200:
            raise FetchError(f"manifest {redact(url)}: HTTP {status}", retryable=status >= 500)
        if "json" not in ctype:
            raise FetchError(f"{redact(url)} answered {ctype or 'no content type'} where a version manifest (JSON) "
                             "was expected; is this a plain file server rather than an llmgw mirror?", retryable=False)
        try:
            return read_small(opened, MAX_JSON_BYTES)
        except ValueError:
            raise FetchError(f"manifest {redact(url)} is larger than {MAX_JSON_BYTES} bytes", retryable=False) from None
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"manifest {redact(url)}: {type(exc).__name__}") from None
    finally:
        opened.close()


def _head(url: str, limits: Limits) -> tuple[int | None, str | None]:
    """A file's size and sha256 as the mirror states them (`HEAD`, no body; blocking). (None, None) when it
    states none or cannot be asked: then the file is fetched from the mirror alone."""
    try:
        opened = open_url(url, None, timeout_s=limits.stall_s, method="HEAD")
    except (URLRefused, OSError, http.client.HTTPException) as exc:
        log.warning("cannot ask %s for its sha256 (%s)", redact(url), type(exc).__name__)
        return None, None
    try:
        if opened.status != 200:
            return None, None
        sha = (opened.headers.get(SHA_HEADER) or "").strip().lower()
        length = opened.headers.get("Content-Length")
        size = int(length) if length and length.isdigit() else None
        return size, sha if SHA256.fullmatch(sha) else None
    finally:
        opened.close()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size
