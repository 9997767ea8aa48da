"""Download one file over HTTP, resumably, hashing while it arrives: the one mechanism under the node's
fetcher and the mirror's `mirror add`.

The rules, each from a way weights went wrong (issue 11, seeds 000):
- A file is written to a partial beside its target and renamed into place only when complete and
  verified, after an fsync of the file; the directory is fsynced after the rename. A partial under the
  target's name would be found, reported present and handed to an engine that fails on it.
- Every attempt writes its own partial (`<name>.<random>.part`), and the caller holds an exclusive lock
  per target (`target_lock`), so two fetchers on one cache (two agents on a shared disk, a retried
  activity still running) never write into one file. An attempt adopts what an earlier one left (the one
  its heartbeat names first, else the largest) by renaming it to its own name, which only one can do.
- Resume asks for `Range: bytes=<partial size>-`. A `206` must say `Content-Range: bytes <that size>-...`;
  any other start means the server sent other bytes, and the partial is discarded (appending them would
  corrupt the file). A `200` to a ranged request starts over. A `416` means "verify", never "done": the
  partial counts as complete only when the `416`'s `Content-Range: bytes */<total>` equals its size (and
  its sha256 matches when one is expected); otherwise it is discarded and the file fetched again.
- Limits (`Limits`): at least `stall_bytes` every `stall_s` (a server sending one byte every 59 s times
  out, which a per-read timeout of 60 s never did), an overall deadline per attempt, a size cap, and no
  more bytes than the server or the manifest announced. A web page (`text/html`) is not a weights file.
- Failures that cannot succeed on retry (4xx, a different size or checksum than promised, a refused
  address) remove the partial; retryable ones (a dropped connection, a stall, 5xx) leave it to resume.
- Messages and logs carry redacted URLs only (`urls.redact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import aiohttp

from llmgw.weights.manifest import SHA256, fsync_dir
from llmgw.weights.urls import AddressPolicy, PolicyResolver, URLRefused, open_url, redact, scrub

log = logging.getLogger(__name__)
CHUNK = 1 << 20
SHA_HEADER = "X-Llmgw-Sha256"
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED = re.compile(r"bytes \*/(\d+)")

Progress = Callable[[int, int | None], None]  # (bytes so far, total or None)


class FetchError(RuntimeError):
    """A fetch that failed. `retryable` False: it cannot succeed as asked (bad source, missing file,
    checksum or size other than promised, refused address); the message says what to change."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Limits:
    """Per-file fetch limits (settings `LLMGW_FETCH_*`). `stall_bytes` every `stall_s` at least;
    `deadline_s` for one attempt at one file; `max_bytes` per file."""

    stall_s: float = 60.0
    stall_bytes: int = 1 << 20
    deadline_s: float = 12 * 3600.0
    max_bytes: int = 1 << 40
    connect_s: float = 15.0

    @classmethod
    def from_settings(cls, s) -> "Limits":
        return cls(stall_s=s.fetch_stall_s, stall_bytes=s.fetch_stall_bytes, deadline_s=s.fetch_deadline_s,
                   max_bytes=s.fetch_max_bytes)


@dataclass
class Downloaded:
    size: int
    sha256: str
    resumed_from: int = 0  # bytes already on disk when the last attempt began
    received: int = 0  # bytes received over HTTP by this call, all attempts


def new_session(limits: Limits, policy: AddressPolicy | None = None) -> aiohttp.ClientSession:
    """An HTTP session for weight fetches: bytes as sent (no decompression, so sizes and ranges mean
    bytes on disk), the address policy enforced at connect time, reads bounded by the stall watchdog.
    aiohttp buffers up to twice `read_bufsize` ahead of us, and drops that buffer when the connection
    fails: half a chunk keeps what a resume fetches again within one chunk (bench/fetch.py)."""
    connector = aiohttp.TCPConnector(resolver=PolicyResolver(policy) if policy else None, limit=64)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, read_bufsize=CHUNK // 2,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=limits.connect_s),
        headers={"Accept-Encoding": "identity", "User-Agent": "llmgw"})


@contextlib.asynccontextmanager
async def target_lock(work_dir: Path, dest: Path) -> AsyncIterator[None]:
    """Hold an exclusive lock on one target while fetching it (waits, without blocking the event loop,
    while another process or task holds it). Whoever gets the lock checks first whether `dest` exists:
    that is why the lock file can be removed once it does (a waiter on the removed file finds `dest`)."""
    lock = work_dir / f"{dest.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        if dest.exists():
            lock.unlink(missing_ok=True)
        os.close(fd)


def adopt_partial(work_dir: Path, name: str, hint: str | None = None) -> Path:
    """A partial of our own for `name`: what an earlier attempt left (`hint` first, the one its heartbeat
    named; else the largest), renamed to a fresh unique name, or a new empty one. Other leftovers are
    removed. Call with the target's lock held."""
    mine = work_dir / f"{name}.{secrets.token_hex(6)}.part"
    own = re.compile(re.escape(name) + r"\.(?:[0-9a-f]{12}|legacy)\.part")
    leftovers = [Path(p) for p in glob.glob(str(work_dir / f"{glob.escape(name)}.*.part"))
                 if own.fullmatch(Path(p).name)]  # not `model.safetensors.index.json.*` for `model.safetensors`
    leftovers.sort(key=lambda p: (p.name != hint, -_size_or_zero(p)))
    adopted = False
    for p in leftovers:
        try:
            if not adopted:
                os.rename(p, mine)
                adopted = True
            else:
                p.unlink()
        except FileNotFoundError:
            continue
    if not adopted:
        mine.touch()
    return mine


def _size_or_zero(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def sha256_of(path: Path, upto: int | None = None) -> "hashlib._Hash":
    h = hashlib.sha256()
    left = upto if upto is not None else -1
    with open(path, "rb") as f:
        while left != 0:
            block = f.read(CHUNK if left < 0 else min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block) if left > 0 else 0
    return h


class _Restart(Exception):
    """The partial cannot be continued (wrong range, a 416 that does not confirm it): start from zero."""


async def download(session: aiohttp.ClientSession, url: str, dest: Path, work_dir: Path, *,
                   expect_size: int | None = None, expect_sha: str | None = None, progress: Progress | None = None,
                   limits: Limits = Limits(), policy: AddressPolicy | None = None, resume_hint: str | None = None,
                   on_partial: Callable[[str], None] | None = None, refuse_html: bool = True) -> Downloaded:
    """Fetch `url` into `dest` (see the module docstring), resuming a partial under `work_dir`. The
    caller holds `target_lock(work_dir, dest)`. `on_partial(name)` learns which partial this attempt
    writes (the mirror heartbeats it). Returns size and sha256; raises `FetchError`."""
    if expect_sha is not None and not SHA256.fullmatch(expect_sha):
        raise FetchError(f"expected sha256 {expect_sha!r} for {dest.name} is not 64 lowercase hex digits", retryable=False)
    partial = await asyncio.to_thread(adopt_partial, work_dir, dest.name, resume_hint)
    if on_partial:
        on_partial(partial.name)
    received = [0]
    try:
        for _ in range(3):
            have = partial.stat().st_size
            if expect_size is not None and have > expect_size:
                have = _truncate(partial)
            try:
                size, sha, have = await _attempt(session, url, partial, have, expect_size, expect_sha, progress,
                                                 limits, policy, refuse_html, received)
                break
            except _Restart as why:
                log.warning("%s: %s; fetching %s again from the start", redact(url), why, dest.name)
                _truncate(partial)
        else:
            raise FetchError(f"{redact(url)}: the server does not answer ranges consistently; gave up")
        await asyncio.to_thread(_publish, partial, dest)
        return Downloaded(size, sha, resumed_from=have, received=received[0])
    except URLRefused as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(str(exc), retryable=False) from None
    except FetchError as exc:
        if not exc.retryable or isinstance(exc, _ShaMismatch):
            partial.unlink(missing_ok=True)
        raise
    except (aiohttp.ClientError, OSError) as exc:
        raise FetchError(f"{redact(url)}: {scrub(f'{type(exc).__name__}: {exc}', url)}") from None


def _truncate(partial: Path) -> int:
    with open(partial, "r+b") as f:
        f.truncate(0)
    return 0


def _publish(partial: Path, dest: Path) -> None:
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, dest)
    fsync_dir(dest.parent)


async def _attempt(session, url, partial: Path, have: int, expect_size, expect_sha, progress, limits: Limits,
                   policy, refuse_html: bool, received: list[int]) -> tuple[int, str, int]:
    """One request. Returns (size, sha256, bytes the partial had when the body began)."""
    loop = asyncio.get_running_loop()
    overall = loop.time() + limits.deadline_s
    hasher = await asyncio.to_thread(sha256_of, partial) if have else hashlib.sha256()
    headers = {"Range": f"bytes={have}-"} if have else {}
    n = have
    watchdog = asyncio.timeout_at(min(loop.time() + limits.stall_s, overall))
    try:
        async with watchdog:
            async with open_url(session, url, policy, headers) as opened:
                r = opened.response
                total = _check_response(r, url, have, expect_size, limits, refuse_html)
                if r.status == 416:
                    return (*_verify(have, hasher.hexdigest(), expect_size, expect_sha, url), have)
                if r.status == 200 and have:
                    log.info("%s ignored the range request; fetching from the start", redact(url))
                    have = n = _truncate(partial)
                    hasher = hashlib.sha256()
                expect_sha = expect_sha or _declared_sha(r.headers, url)
                if total is not None:
                    free = shutil.disk_usage(partial.parent).free
                    if total - have > free:
                        raise FetchError(f"{redact(url)}: needs {total - have} more bytes but {partial.parent} has "
                                         f"{free} free", retryable=False)
                cap = min(x for x in (total, expect_size, limits.max_bytes) if x is not None)
                step = max(1, min(CHUNK, limits.stall_bytes))
                mark = n
                fd = os.open(partial, os.O_WRONLY | os.O_APPEND)
                pending: asyncio.Future | None = None
                buf = bytearray()
                try:
                    while True:
                        piece = await r.content.read(step - len(buf))
                        if piece:
                            if n + len(buf) + len(piece) > cap:
                                raise FetchError(f"{redact(url)}: the server sent more than {cap} bytes "
                                                 f"({'as announced' if cap == total else 'the limit'}); refused",
                                                 retryable=False)
                            buf += piece
                            received[0] += len(piece)
                            if len(buf) < step:
                                if progress:
                                    progress(n + len(buf), total)
                                continue
                        if not buf:
                            break
                        if pending is not None:
                            await pending
                        # Writing and hashing run in a thread while the loop reads the next block.
                        block, buf = buf, bytearray()
                        pending = asyncio.ensure_future(asyncio.to_thread(_write_hash, fd, hasher, block))
                        n += len(block)
                        if progress:
                            progress(n, total)
                        need = limits.stall_bytes if total is None else min(limits.stall_bytes, total - mark)
                        if n - mark >= need:
                            mark = n
                            watchdog.reschedule(min(loop.time() + limits.stall_s, overall))
                        if not piece:
                            break
                    if pending is not None:
                        await pending
                finally:
                    if pending is not None and not pending.done():
                        await asyncio.gather(pending, return_exceptions=True)
                    if buf:  # what arrived before a failure is kept: the resume does not fetch it again
                        _write_hash(fd, hasher, buf)
                        n += len(buf)
                    os.close(fd)
    except TimeoutError:
        if not watchdog.expired():
            raise FetchError(f"{redact(url)}: timed out connecting") from None
        what = "the fetch deadline (LLMGW_FETCH_DEADLINE_S)" if loop.time() >= overall - 0.5 else \
            f"less than {limits.stall_bytes} bytes in {limits.stall_s:g}s (LLMGW_FETCH_STALL_S)"
        raise FetchError(f"{redact(url)}: stalled at {n} bytes: {what}") from None
    if total is not None and n != total:
        raise FetchError(f"{redact(url)}: connection ended at {n} of {total} bytes")
    return (*_verify(n, hasher.hexdigest(), expect_size, expect_sha, url), have)


def _write_hash(fd: int, hasher, block: bytes) -> None:
    view = memoryview(block)
    while view:
        view = view[os.write(fd, view):]
    hasher.update(block)


def _check_response(r: aiohttp.ClientResponse, url: str, have: int, expect_size: int | None, limits: Limits,
                    refuse_html: bool) -> int | None:
    """The file's total size as the response states it (None when it does not); raises for statuses and
    ranges that cannot be used, `_Restart` for a partial that cannot be continued."""
    if r.status == 416:
        m = _UNSATISFIED.fullmatch(r.headers.get("Content-Range", "").strip())
        if not have or m is None or int(m[1]) != have:
            raise _Restart(f"416 with Content-Range {r.headers.get('Content-Range')!r} for a {have}-byte partial")
        return have
    if r.status == 206:
        m = _RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
        if m is None or int(m[1]) != have:
            raise _Restart(f"asked for bytes from {have}, the server sent Content-Range "
                           f"{r.headers.get('Content-Range')!r}")
        total = None if m[3] == "*" else int(m[3])
    elif r.status == 200:
        total = r.content_length
    elif r.status in (404, 410):
        raise FetchError(f"{redact(url)}: HTTP {r.status} (no such file)", retryable=False)
    elif 400 <= r.status < 500 and r.status not in (408, 425, 429):
        raise FetchError(f"{redact(url)}: HTTP {r.status}", retryable=False)
    else:
        raise FetchError(f"{redact(url)}: HTTP {r.status}")
    ctype = r.headers.get("Content-Type", "")
    if refuse_html and ctype.startswith(("text/html", "application/xhtml")):
        raise FetchError(f"{redact(url)} is a web page ({ctype.split(';')[0]}), not a weights file; give the file's "
                         "download URL", retryable=False)
    if total is not None and expect_size is not None and total != expect_size:
        raise FetchError(f"{redact(url)}: the server has {total} bytes where {expect_size} were expected", retryable=False)
    if total is not None and total > limits.max_bytes:
        raise FetchError(f"{redact(url)}: {total} bytes is over the limit of {limits.max_bytes} "
                         "(LLMGW_FETCH_MAX_BYTES)", retryable=False)
    return total


def _declared_sha(headers, url: str) -> str | None:
    sha = headers.get(SHA_HEADER)
    if sha is None:
        return None
    if not SHA256.fullmatch(sha):
        raise FetchError(f"{redact(url)}: {SHA_HEADER} {sha[:80]!r} is not a sha256", retryable=False)
    return sha


def _verify(size: int, sha: str, expect_size: int | None, expect_sha: str | None, url: str) -> tuple[int, str]:
    if expect_size is not None and size != expect_size:
        raise FetchError(f"{redact(url)}: got {size} bytes where {expect_size} were expected", retryable=False)
    if expect_sha and sha != expect_sha:
        # Retryable: bytes corrupted on the way are fetched again, from zero (the partial is removed).
        raise _ShaMismatch(f"{redact(url)}: sha256 mismatch (got {sha}, expected {expect_sha})")
    return size, sha


class _ShaMismatch(FetchError):
    def __init__(self, message: str):
        super().__init__(message, retryable=True)
