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

The body is read in a thread with a blocking client (`http.py`): fill a chunk, writing each piece
(`PIECE`) as it is received, hand the chunk to a second thread that hashes it and starts its writeback to
disk, fill the next. Written before hashed, so a killed process loses at most the piece it was reading; a
failed connection loses nothing it received.
Writeback started chunk by chunk (`sync_file_range`, asynchronous) leaves the final fsync little to wait
for: without it that fsync wrote the whole file after the last byte arrived (0.22 s per 512 MB here,
about a third of curl's whole fetch time; bench/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import http.client
import logging
import os
import queue
import re
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from llmgw.weights.http import PeerTLS, abort, open_url
from llmgw.weights.manifest import SHA256, fsync_dir
from llmgw.weights.urls import AddressPolicy, URLRefused, redact, scrub

log = logging.getLogger(__name__)
CHUNK = 1 << 20
# The most one receive reads, and so one write writes: a 1 MiB write into ext4's page cache cost 0.6-1.0 s of
# system time per GB, written in 256 KiB pieces 0.2 s (the piece still in the CPU's cache when copied twice).
PIECE = 256 << 10
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


def sha256_of(path: Path) -> "hashlib._Hash":
    """The sha256 state of a file's bytes (to continue hashing a resumed partial)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h


class _Restart(Exception):
    """The partial cannot be continued (wrong range, a 416 that does not confirm it): start from zero."""


class _Stopped(Exception):
    """The download was cancelled (its task, the activity, the worker stopping)."""


async def download(url: str, dest: Path, work_dir: Path, *, expect_size: int | None = None,
                   expect_sha: str | None = None, progress: Progress | None = None, limits: Limits = Limits(),
                   policy: AddressPolicy | None = None, resume_hint: str | None = None,
                   on_partial: Callable[[str], None] | None = None, refuse_html: bool = True,
                   peer: PeerTLS | None = None) -> Downloaded:
    """Fetch `url` into `dest` (see the module docstring), resuming a partial under `work_dir`. The
    caller holds `target_lock(work_dir, dest)`. `progress(bytes, total)` is called on the event loop a few
    times a second; `on_partial(name)` learns which partial this attempt writes (the mirror heartbeats it).
    `peer`: `url` is a peer node's cache, reached over mutual TLS (weights/http.py).
    Returns size and sha256; raises `FetchError`. Cancelled, it stops the transfer and keeps what arrived."""
    if expect_sha is not None and not SHA256.fullmatch(expect_sha):
        raise FetchError(f"expected sha256 {expect_sha!r} for {dest.name} is not 64 lowercase hex digits", retryable=False)
    partial = await asyncio.to_thread(adopt_partial, work_dir, dest.name, resume_hint)
    if on_partial:
        on_partial(partial.name)
    loop = asyncio.get_running_loop()
    job = _Transfer(url, partial, expect_size, expect_sha, limits, policy, refuse_html,
                    (lambda n, t: loop.call_soon_threadsafe(progress, n, t)) if progress else None, peer)
    done: asyncio.Future = loop.create_future()

    def settle(result=None, error: BaseException | None = None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result = job.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)

    # Its own thread, not the default executor: the transfer blocks for as long as the file takes.
    threading.Thread(target=run, name=f"fetch {dest.name}", daemon=True).start()
    try:
        size, sha, resumed_from = await asyncio.shield(done)
        await asyncio.to_thread(_publish, partial, dest)
        return Downloaded(size, sha, resumed_from=resumed_from, received=job.received)
    except asyncio.CancelledError:
        job.stop()
        await asyncio.gather(done, return_exceptions=True)  # the thread has written what it had, and closed
        raise
    except URLRefused as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(str(exc), retryable=False) from None
    except FetchError as exc:
        if not exc.retryable or isinstance(exc, _ShaMismatch):
            partial.unlink(missing_ok=True)
        raise
    except (OSError, http.client.HTTPException) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Kept, the partial would hold the full disk (and fail every other fetch on it) for a retry that
            # fails the same way: removed, and said once.
            partial.unlink(missing_ok=True)
            raise FetchError(f"{redact(url)}: the disk holding {work_dir} is full ({exc.strerror}); free space "
                             "(`llmgw ctl reclaim --collect`) and start it again", retryable=False) from None
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


class _Transfer:
    """One file's transfer, run in its own thread (`run`); `stop` from any thread ends it promptly."""

    def __init__(self, url: str, partial: Path, expect_size: int | None, expect_sha: str | None, limits: Limits,
                 policy: AddressPolicy | None, refuse_html: bool, progress: Progress | None,
                 peer: PeerTLS | None = None):
        self.url = url
        self.peer = peer
        self.partial = partial
        self.expect_size = expect_size
        self.expect_sha = expect_sha
        self.limits = limits
        self.policy = policy
        self.refuse_html = refuse_html
        self.progress = progress
        self.received = 0
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None

    def stop(self) -> None:
        self._stop.set()
        abort(self._conn)

    def _on_conn(self, conn: http.client.HTTPConnection) -> None:
        self._conn = conn
        if self._stop.is_set():
            abort(conn)

    def run(self) -> tuple[int, str, int]:
        unconfirmed = False
        for _ in range(3):
            have = self.partial.stat().st_size
            if self.expect_size is not None and have > self.expect_size:
                have = _truncate(self.partial)
            try:
                return self._attempt(have)
            except _Restart as why:
                log.warning("%s: %s; fetching %s again from the start", redact(self.url), why, self.partial.name)
                _truncate(self.partial)
            except _Unconfirmed:  # asked again from its end: a 416 stating that size confirms it is whole
                unconfirmed = True
        if unconfirmed:
            raise FetchError(f"{redact(self.url)}: the server states no length for it and does not confirm one when "
                             "asked for the bytes after its end, so a cut download cannot be told from the whole "
                             "file; serve it with a Content-Length or give its sha256", retryable=False)
        raise FetchError(f"{redact(self.url)}: the server does not answer ranges consistently; gave up")

    def _attempt(self, have: int) -> tuple[int, str, int]:
        """One request. Returns (size, sha256, bytes the partial had when the body began)."""
        lim = self.limits
        started = time.monotonic()
        deadline = started + lim.deadline_s
        hasher = sha256_of(self.partial) if have else hashlib.sha256()
        headers = {"Range": f"bytes={have}-"} if have else {}
        n = have
        try:
            opened = open_url(self.url, self.policy, headers, timeout_s=lim.stall_s, on_conn=self._on_conn,
                              peer=self.peer)
        except socket.timeout:
            raise FetchError(f"{redact(self.url)}: no answer within {lim.stall_s:g}s") from None
        except OSError as exc:
            if self._stop.is_set():
                raise _Stopped() from None
            raise FetchError(f"{redact(self.url)}: {scrub(str(exc), self.url)}") from None
        try:
            r = opened.response
            total = _check_response(r.status, r.headers, self.url, have, self.expect_size, lim, self.refuse_html)
            if r.status == 416:  # the partial is the whole file: its sha256 is checked as any file's is
                opened.close()
                declared = self.expect_sha or self._declared_sha_at(have - 1)
                return (*_verify(have, hasher.hexdigest(), self.expect_size, declared, self.url), have)
            # A body with no stated length (not chunked either) ends when the connection closes, which is also
            # what a connection cut half-way looks like.
            framed = total is not None or "chunked" in (r.headers.get("Transfer-Encoding") or "").lower()
            if r.status == 200 and have:
                log.info("%s ignored the range request; fetching from the start", redact(self.url))
                have = n = _truncate(self.partial)
                hasher = hashlib.sha256()
            expect_sha = self.expect_sha or _declared_sha(r.headers, self.url)
            if total is not None:
                free = shutil.disk_usage(self.partial.parent).free
                if total - have > free:
                    raise FetchError(f"{redact(self.url)}: needs {total - have} more bytes but {self.partial.parent} "
                                     f"has {free} free", retryable=False)
            cap = min(x for x in (total, self.expect_size, lim.max_bytes) if x is not None)
            n = self._body(opened, n, total, cap, hasher, deadline)
        finally:
            opened.close()
        if total is not None and n != total:
            raise FetchError(f"{redact(self.url)}: connection ended at {n} of {total} bytes")
        if not framed:
            if self.expect_size is not None and n < self.expect_size:  # cut: kept, and resumed by the retry
                raise FetchError(f"{redact(self.url)}: connection ended at {n} of {self.expect_size} bytes")
            if self.expect_size is None and not expect_sha:
                raise _Unconfirmed()
        return (*_verify(n, hasher.hexdigest(), self.expect_size, expect_sha, self.url, from_zero=not have), have)

    def _declared_sha_at(self, offset: int) -> str | None:
        """The sha256 the server declares for the file (`X-Llmgw-Sha256`: the mirror does), asked with a range
        from `offset`: a 416 carries none, and a partial that is whole is checked like any file."""
        try:
            opened = open_url(self.url, self.policy, {"Range": f"bytes={offset}-"}, timeout_s=self.limits.stall_s,
                              on_conn=self._on_conn)
        except OSError as exc:
            raise FetchError(f"{redact(self.url)}: {scrub(str(exc), self.url)}") from None
        try:
            return _declared_sha(opened.response.headers, self.url)
        finally:
            opened.close()

    def _body(self, opened, n: int, total: int | None, cap: int, hasher, deadline: float) -> int:
        """Read the body into the partial from byte `n`; returns the bytes the partial holds after.

        Per receive it does only what the limits need: one clock read, a read of at most `PIECE` straight
        into a pooled buffer (`Opened.readinto1`) and its write, and the socket timeout set again only when
        the time left before a stall differs from it by more than `slack` (a syscall per receive was a tenth
        of the CPU per GB)."""
        lim = self.limits
        step = max(1, min(CHUNK, lim.stall_bytes))
        mark, mark_t, told = n, time.monotonic(), 0.0
        slack = min(0.5, lim.stall_s / 20)
        timeout = -1.0  # what the socket's timeout is set to now
        fd = os.open(self.partial, os.O_WRONLY | os.O_APPEND)
        hashing = _Hasher(hasher, step, fd, n)
        try:
            while True:
                buf = hashing.take()
                view = memoryview(buf)
                got = written = 0
                try:
                    while got < step:
                        try:
                            now = time.monotonic()
                            if now > deadline:
                                raise FetchError(f"{redact(self.url)}: stalled at {n + got} bytes: the fetch deadline "
                                                 "(LLMGW_FETCH_DEADLINE_S)")
                            if now > mark_t + lim.stall_s:
                                raise socket.timeout()
                            # Never longer than the time left (plus `slack`), never shorter: a stall is noticed
                            # within `slack` of its limit, and never before it.
                            left = max(0.01, min(mark_t + lim.stall_s, deadline) - now)
                            if left > timeout or left < timeout - slack:
                                opened.settimeout(left)
                                timeout = left
                            # What one recv gives, at most a `PIECE`: a trickle must not block the checks.
                            k = opened.readinto1(view[got:min(step, got + PIECE)])
                            if not k:
                                break
                            got += k
                            self.received += k
                            if n + got > cap:
                                raise FetchError(f"{redact(self.url)}: the server sent more than {cap} bytes "
                                                 f"({'as announced' if cap == total else 'the limit'}); refused",
                                                 retryable=False)
                            need = lim.stall_bytes if total is None else min(lim.stall_bytes, total - mark)
                            if n + got - mark >= need:
                                mark, mark_t = n + got, time.monotonic()  # after the read, which may have waited
                            if self.progress and now - told >= 0.2:
                                told = now
                                self.progress(n + got, total)
                        except socket.timeout:
                            raise FetchError(f"{redact(self.url)}: stalled at {n + got} bytes: less than "
                                             f"{lim.stall_bytes} bytes in {lim.stall_s:g}s (LLMGW_FETCH_STALL_S)"
                                             ) from None
                        except (OSError, http.client.HTTPException) as exc:
                            if self._stop.is_set():
                                raise _Stopped() from None
                            raise FetchError(f"{redact(self.url)}: connection ended at {n + got} bytes "
                                             f"({type(exc).__name__})") from None
                        finally:
                            # Written first, what arrived is kept for the resume whatever happens next; and
                            # written piece by piece, while the piece is still in the CPU's cache.
                            if got > written:
                                _write_all(fd, view[written:got])
                                written = got
                finally:
                    n += got
                    hashing.put(buf, got)
                if got < step:
                    break
        finally:
            hashing.finish()
            os.close(fd)
            if self.progress:
                self.progress(n, total)
        return n


class _Hasher:
    """Hashes blocks in a second thread while the first reads the next (sha256 releases the GIL), and
    starts the writeback of each block hashed (`fd`, the file the blocks were written to from `offset` on).

    The blocks are `POOL` buffers of `size` bytes, handed back and forth: `take()` gives one the hasher is
    done with, `put(buf, n)` hands its first `n` bytes over, already written. Reusing them saves allocating
    (and the kernel zeroing) a fresh megabyte per megabyte received."""

    POOL = 6

    def __init__(self, hasher, size: int, fd: int, offset: int):
        self.hasher = hasher
        self.fd = fd
        self.offset = offset
        self.todo: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        for _ in range(self.POOL):
            self.free.put(bytearray(size))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n = item
            if n:
                with memoryview(buf) as view:
                    self.hasher.update(view[:n])
                _start_writeback(self.fd, self.offset, n)
                self.offset += n
            self.free.put(buf)

    def take(self) -> bytearray:
        return self.free.get()

    def put(self, buf: bytearray, n: int) -> None:
        self.todo.put((buf, n))

    def finish(self) -> None:
        self.todo.put(None)
        self.thread.join()


def _sync_file_range():
    """Linux's `sync_file_range` (not in `os`), or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).sync_file_range  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages


def _start_writeback(fd: int, offset: int, n: int) -> None:
    """Start writing bytes `offset..offset+n` of `fd` to disk, without waiting for the writes to finish (it
    may wait for room in the device's queue, which holds back the hasher, then the reader: a fetch no faster
    than the disk). A no-op on tmpfs and where the call does not exist. Its result is not checked: the
    fsync before the rename reports any write error, and is what makes the file durable."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, n, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _check_response(status: int, headers, url: str, have: int, expect_size: int | None, limits: Limits,
                    refuse_html: bool) -> int | None:
    """The file's total size as the response states it (None when it does not); raises for statuses and
    ranges that cannot be used, `_Restart` for a partial that cannot be continued."""
    if status == 416:
        m = _UNSATISFIED.fullmatch((headers.get("Content-Range") or "").strip())
        if not have or m is None or int(m[1]) != have:
            raise _Restart(f"416 with Content-Range {headers.get('Content-Range')!r} for a {have}-byte partial")
        return have
    if status == 206:
        m = _RANGE.fullmatch((headers.get("Content-Range") or "").strip())
        if m is None or int(m[1]) != have:
            raise _Restart(f"asked for bytes from {have}, the server sent Content-Range "
                           f"{headers.get('Content-Range')!r}")
        total = None if m[3] == "*" else int(m[3])
    elif status == 200:
        length = headers.get("Content-Length")
        total = int(length) if length and length.isdigit() and "chunked" not in \
            (headers.get("Transfer-Encoding") or "").lower() else None
    elif status in (404, 410):
        raise FetchError(f"{redact(url)}: HTTP {status} (no such file)", retryable=False)
    elif 400 <= status < 500 and status not in (408, 409, 425, 429):  # 409: the mirror's "not ready yet"
        raise FetchError(f"{redact(url)}: HTTP {status}", retryable=False)
    else:
        raise FetchError(f"{redact(url)}: HTTP {status}")
    ctype = headers.get("Content-Type") or ""
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


def _verify(size: int, sha: str, expect_size: int | None, expect_sha: str | None, url: str,
            from_zero: bool = False) -> tuple[int, str]:
    if expect_size is not None and size != expect_size:
        raise FetchError(f"{redact(url)}: got {size} bytes where {expect_size} were expected", retryable=False)
    if expect_sha and sha != expect_sha:
        if from_zero:  # every byte from this one answer: the server has other bytes (the origin changed since
            # it was planned), which fetching it whole again, up to 20 times, would only confirm
            raise _ShaMismatch(f"{redact(url)}: sha256 mismatch (got {sha}, expected {expect_sha}) for the whole "
                               "file fetched in one answer: the server has other bytes than expected", retryable=False)
        # Retryable: a resumed file whose earlier part was corrupt or stale is fetched again, from zero
        # (the partial is removed).
        raise _ShaMismatch(f"{redact(url)}: sha256 mismatch (got {sha}, expected {expect_sha})")
    return size, sha


class _Unconfirmed(Exception):
    """A body with no stated length ended: whole, or cut? Asked again from its end to know."""


class _ShaMismatch(FetchError):
    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message, retryable=retryable)
