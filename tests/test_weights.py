"""Fetching weights through a real mirror over HTTP: atomic writes, Range resume, single flight,
checksums, version manifests, and names that cannot escape the mirror."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import types
from pathlib import Path

import aiohttp
import pytest
import uvicorn

from llmgw.dev.procs import free_port, wait_port
from llmgw.weights import download as download_mod
from llmgw.weights.download import download
from llmgw.weights.fetcher import FetchError, Fetcher
from llmgw.mirror.server import create_mirror_app
from llmgw.weights.naming import cache_name_for, parse_source


class CountingApp:
    """Wraps the mirror app and counts GET requests per path (to prove single flight)."""

    def __init__(self, app):
        self.app = app
        self.gets: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.gets[scope["path"]] = self.gets.get(scope["path"], 0) + 1
        await self.app(scope, receive, send)


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    app = CountingApp(create_mirror_app(root))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_port(port, 10)
    yield root, f"http://127.0.0.1:{port}", app
    server.should_exit = True
    t.join(5)


def write(path: Path, size: int) -> bytes:
    data = (hashlib.sha256(path.name.encode()).digest() * (size // 32 + 1))[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


async def test_fetch_writes_beside_target_and_serves_from_cache(mirror, tmp_path):
    root, url, app = mirror
    data = write(root / "m.gguf", 3_000_000)
    f = Fetcher(tmp_path / "cache", url)
    got = await f.fetch("mirror:m.gguf")
    assert got.fetched and Path(got.path).read_bytes() == data
    assert Path(got.path).name == cache_name_for("mirror:m.gguf")
    assert not list((tmp_path / "cache" / ".partial").iterdir())  # nothing left beside it
    again = await f.fetch("mirror:m.gguf")
    assert again.path == got.path and not again.fetched
    assert app.gets["/files/m.gguf"] == 1


async def test_concurrent_fetches_of_one_source_make_one_download(mirror, tmp_path):
    root, url, app = mirror
    write(root / "big.gguf", 20_000_000)
    f = Fetcher(tmp_path / "cache", url)
    results = await asyncio.gather(*[f.fetch("mirror:big.gguf") for _ in range(8)])
    assert len({r.path for r in results}) == 1
    assert app.gets["/files/big.gguf"] == 1


async def test_interrupted_download_resumes_with_range(mirror, tmp_path):
    root, url, _ = mirror
    data = write(root / "r.gguf", 5_000_000)
    (tmp_path / "r.gguf.0123456789ab.part").write_bytes(data[:1_234_567])  # what an interrupted fetch left
    seen = []
    got = await download(url + "/files/r.gguf", tmp_path / "r.gguf", tmp_path,
                         progress=lambda n, t: seen.append((n, t)))
    assert got.size == len(data) and (tmp_path / "r.gguf").read_bytes() == data
    assert got.resumed_from == 1_234_567 and got.received == len(data) - 1_234_567
    assert seen[0][0] > 1_234_567 and seen[-1] == (len(data), len(data))  # continued, did not restart
    assert not list(tmp_path.glob("*.part"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
async def test_writeback_is_started_for_every_byte_written_from_the_resume_offset(mirror, tmp_path, monkeypatch):
    # The final fsync then has little left to write (bench/README.md); a wrong offset would start nothing.
    root, url, _ = mirror
    data = write(root / "w.gguf", 5_000_000)
    (tmp_path / "w.gguf.0123456789ab.part").write_bytes(data[:1_234_567])
    assert download_mod._SYNC_FILE_RANGE is not None
    real, ranges = download_mod._SYNC_FILE_RANGE, []

    def recording(fd, offset, n, flags):
        ranges.append((offset, n, flags))
        return real(fd, offset, n, flags)

    monkeypatch.setattr(download_mod, "_SYNC_FILE_RANGE", recording)
    got = await download(url + "/files/w.gguf", tmp_path / "w.gguf", tmp_path)
    assert got.size == len(data) and (tmp_path / "w.gguf").read_bytes() == data
    assert ranges[0][0] == 1_234_567 and all(flags == 2 for _, _, flags in ranges)
    assert all(o + n == nxt for (o, n, _), (nxt, _, _) in zip(ranges, ranges[1:]))  # contiguous, in order
    assert ranges[-1][0] + ranges[-1][1] == len(data)


async def test_checksum_mismatch_is_refused_and_partial_removed(mirror, tmp_path):
    root, url, _ = mirror
    write(root / "x.gguf", 100_000)
    with pytest.raises(FetchError, match="sha256 mismatch") as exc:
        await download(url + "/files/x.gguf", tmp_path / "x.gguf", tmp_path, expect_sha="0" * 64)
    assert not list(tmp_path.glob("*.part")) and not (tmp_path / "x.gguf").exists()
    # The whole file in one answer, and other bytes: fetching it again (20 times, in the mirror) only confirms it.
    assert not exc.value.retryable and "the server has other bytes than expected" in str(exc.value)


async def test_version_is_fetched_whole_from_its_manifest(mirror, tmp_path):
    root, url, _ = mirror
    a = write(root / "org" / "model" / "model-00001-of-00002.safetensors", 200_000)
    b = write(root / "org" / "model" / "model-00002-of-00002.safetensors", 300_000)
    write(root / "org" / "model" / "config.json", 100)
    f = Fetcher(tmp_path / "cache", url)
    got = await f.fetch("mirror:org/model/")
    d = Path(got.path)
    assert d.is_dir() and sorted(p.name for p in d.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert (d / "model-00001-of-00002.safetensors").read_bytes() == a
    assert (d / "model-00002-of-00002.safetensors").read_bytes() == b


async def test_version_still_being_written_is_not_served(mirror, tmp_path):
    root, url, _ = mirror
    write(root / "v" / "a.safetensors", 1000)
    write(root / "v" / "b.safetensors.part", 1000)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/files/v/") as r:
            assert r.status == 409
    with pytest.raises(FetchError, match="not ready yet") as exc:  # a node waits (retries); never a partial set
        await Fetcher(tmp_path / "cache", url).fetch("mirror:v/")
    assert exc.value.retryable and [p.name for p in (tmp_path / "cache").iterdir()] == [".partial"]


@pytest.mark.parametrize("name", ["../etc/passwd", "..%2Fetc%2Fpasswd", "a/../../x", ".hidden"])
async def test_mirror_refuses_names_that_escape_or_are_not_plain(mirror, name):
    _, url, _ = mirror
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/files/" + name) as r:
            assert r.status in (400, 404)


async def test_sources_that_need_no_fetch(tmp_path):
    f = Fetcher(tmp_path / "cache", None)
    assert (await f.fetch(None)).path is None
    assert (await f.fetch("Qwen/Qwen2.5-7B-Instruct")).path == "Qwen/Qwen2.5-7B-Instruct"  # passed through
    local = tmp_path / "w.gguf"
    local.write_bytes(b"x")
    assert (await f.fetch(str(local))).path == str(local)
    with pytest.raises(FetchError, match="does not exist"):
        await f.fetch("/nonexistent/model.gguf")
    with pytest.raises(FetchError, match="mirror URL"):
        await f.fetch("mirror:m.gguf")


def test_source_kinds_and_cache_names():
    assert parse_source("mirror:a.gguf", "http://m:8082").url == "http://m:8082/files/a.gguf"
    assert parse_source("https://h/x/").is_version
    assert parse_source("./rel.gguf").kind == "path"
    assert parse_source("org/name").kind == "model_id"
    with pytest.raises(ValueError):
        parse_source("mirror:../x")
    with pytest.raises(ValueError):
        parse_source("s3://bucket/x")
    assert cache_name_for("mirror:a.gguf") != cache_name_for("mirror:b.gguf")
    assert cache_name_for("mirror:a.gguf").endswith("-a.gguf")
    assert cache_name_for("https://h/x/").endswith("-x")


async def test_concurrent_requests_for_an_unrecorded_file_hash_it_once(mirror, monkeypatch):
    """Issue 36: the mirror hashed a file it has no record for once per concurrent request (each reading
    it whole), so a fleet asking at once cost the mirror a fleet's worth of reads."""
    import llmgw.weights.manifest as manifest_module

    root, url, _ = mirror
    data = write(root / "big" / "w.gguf", 48 << 20)
    write(root / "big" / "other.bin", 1 << 20)
    started = []

    class Counting:
        def __init__(self):
            started.append(1)
            self.h = hashlib.sha256()

        def update(self, block):
            self.h.update(block)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(manifest_module, "hashlib", types.SimpleNamespace(sha256=Counting))
    async with aiohttp.ClientSession() as session:
        async def one(method: str, path: str) -> tuple[int, dict, bytes]:
            async with session.request(method, url + path) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()

        answers = await asyncio.gather(*[one("HEAD", "/files/big/w.gguf") for _ in range(24)],
                                       *[one("GET", "/files/big/") for _ in range(8)])
    assert all(a[0] == 200 for a in answers), [a[0] for a in answers]
    want = hashlib.sha256(data).hexdigest()
    assert {a[1]["x-llmgw-sha256"] for a in answers[:24]} == {want}
    assert all({f["name"]: f["sha256"] for f in json.loads(a[2])["files"]}["w.gguf"] == want for a in answers[24:])
    assert len(started) == 2, len(started)  # once for each file, whatever asked and however many at once
