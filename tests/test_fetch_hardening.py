"""Weights that are never wrong (issue 11): each rule through the real fetch path, against a real HTTP
server with the fault it guards against (tests/origin_server.py).

The node's `Fetcher` is what `fetch_weights` runs; `download` with an `AddressPolicy` is what the mirror's
`fetch_mirror_file` runs (its whole path, workflow included, is in test_mirror_workflow.py)."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
from pathlib import Path

import pytest

from llmgw.dev.procs import free_port
from llmgw.weights.download import FetchError, Limits, download, target_lock
from llmgw.weights.fetcher import Fetcher
from llmgw.weights.urls import AddressPolicy, redact
from tests.origin_server import Origin

SHA = "ab" * 32


def blob(name: str, size: int) -> bytes:
    return (hashlib.sha256(name.encode()).digest() * (size // 32 + 1))[:size]


@pytest.fixture
def origin(tmp_path):
    root = tmp_path / "origin"
    root.mkdir()
    o = Origin(root, free_port())
    o.root = root  # type: ignore[attr-defined]
    yield o
    o.stop()


def put(origin, name: str, size: int) -> bytes:
    data = blob(name, size)
    path = origin.root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


async def fetch_with_retries(f: Fetcher, source: str, tries: int = 3):
    """What the fetch_weights activity's retry policy does: try again after a retryable failure."""
    last = None
    for _ in range(tries):
        try:
            return await f.fetch(source)
        except FetchError as exc:
            last = exc
            if not exc.retryable:
                raise
    raise last  # type: ignore[misc]


async def test_a_206_at_another_offset_is_never_appended(origin, tmp_path):
    data = put(origin, "m.gguf", 3_000_000)
    url = f"{origin.url}/m.gguf"
    origin.config["drop"] = {"/m.gguf": 1_000_000}
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError):
        await f.fetch(url)  # the connection drops mid-file: a partial stays to resume
    origin.config["bad_range"] = ["/m.gguf"]  # the resume asks for bytes=1000000- and gets the file from 0
    got = await fetch_with_retries(f, url)
    assert Path(got.path).read_bytes() == data
    resumed = [e for e in origin.log("/m.gguf") if e["range"]]
    assert resumed and resumed[0]["status"] == 206  # the bad answer came, and was not appended


async def test_a_416_is_verified_not_taken_as_done(origin, tmp_path):
    put(origin, "s.gguf", 3_000_000)
    url = f"{origin.url}/s.gguf"
    origin.config["drop"] = {"/s.gguf": 2_000_000}
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError):
        await f.fetch(url)
    new = put(origin, "s.gguf", 1_500_000)  # the origin's file changed: shorter than the partial
    got = await fetch_with_retries(f, url)
    assert Path(got.path).read_bytes() == new
    assert [e["status"] for e in origin.log("/s.gguf")][-2:] == [416, 200]


async def test_a_416_that_confirms_a_partial_still_checks_its_sha256(origin, tmp_path):
    data = put(origin, "v.gguf", 100_000)
    work = tmp_path / "work"
    work.mkdir()
    (work / "v.gguf.0123456789ab.part").write_bytes(data[:50_000] + b"\0" * 50_000)  # full length, wrong bytes
    origin.config["lie_416"] = {"/v.gguf": 100_000}
    with pytest.raises(FetchError, match="sha256 mismatch"):
        await download(f"{origin.url}/v.gguf", work / "v.gguf", work, expect_size=100_000,
                       expect_sha=hashlib.sha256(data).hexdigest())
    assert not (work / "v.gguf").exists() and not list(work.glob("*.part"))


async def test_two_fetchers_on_one_cache_make_one_file(origin, tmp_path):
    """Two agents on a shared cache (two Fetchers, each with its own single flight): one downloads, the
    other waits on the target's lock and finds the file; nothing interleaves."""
    data = put(origin, "big.gguf", 2_000_000)
    origin.config["rate"] = 4_000_000
    url = f"{origin.url}/big.gguf"
    a, b = Fetcher(tmp_path / "cache", None), Fetcher(tmp_path / "cache", None)
    got = await asyncio.gather(a.fetch(url), b.fetch(url))
    assert Path(got[0].path).read_bytes() == data and got[0].path == got[1].path
    assert sorted(g.fetched for g in got) == [False, True]
    assert len(origin.log("/big.gguf")) == 1
    assert not [p for p in (tmp_path / "cache" / ".partial").iterdir()]  # no partial, no lock left


async def test_each_attempt_writes_its_own_partial(origin, tmp_path):
    data = put(origin, "p.gguf", 1_000_000)
    work = tmp_path / "w"
    work.mkdir()
    seen: list[str] = []
    async with target_lock(work, work / "p.gguf"):
        await download(f"{origin.url}/p.gguf", work / "p.gguf", work, on_partial=seen.append)
    (work / "p.gguf").unlink()
    async with target_lock(work, work / "p.gguf"):
        await download(f"{origin.url}/p.gguf", work / "p.gguf", work, on_partial=seen.append)
    assert len(set(seen)) == 2 and all(n.startswith("p.gguf.") and n.endswith(".part") for n in seen)
    assert (work / "p.gguf").read_bytes() == data


# ---- manifests --------------------------------------------------------------------------------------

BAD_MANIFESTS = {
    "sha256 not hex": ({"name": "a.safetensors", "size": 10, "sha256": "z" * 64}, "sha256"),
    "sha256 short": ({"name": "a.safetensors", "size": 10, "sha256": "ab"}, "sha256"),
    "size as a string": ({"name": "a.safetensors", "size": "10", "sha256": SHA}, "size"),
    "size negative": ({"name": "a.safetensors", "size": -1, "sha256": SHA}, "size"),
    "size float": ({"name": "a.safetensors", "size": 10.5, "sha256": SHA}, "size"),
    "name with newline": ({"name": "a.safetensors\n", "size": 10, "sha256": SHA}, "name"),
    "one dot leader": ({"name": "\u2024\u2024", "size": 10, "sha256": SHA}, "name"),
    "fullwidth solidus": ({"name": "x\uff0fetc", "size": 10, "sha256": SHA}, "name"),
    "slash": ({"name": "../etc/passwd", "size": 10, "sha256": SHA}, "name"),
    "backslash": ({"name": "a\\b", "size": 10, "sha256": SHA}, "name"),
    "partial name": ({"name": "a.part", "size": 10, "sha256": SHA}, "name"),
    # The fetch of `w.bin` locks `w.bin.lock` beside it and removes that when done: a file of that name was
    # deleted from the version it came in, which was then half-served.
    "a lock's name": ({"name": "w.bin.lock", "size": 10, "sha256": SHA}, "name"),
    "unknown field": ({"name": "a.safetensors", "size": 10, "sha256": SHA, "path": "/etc"}, "path"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
async def test_a_bad_manifest_refuses_the_version(origin, tmp_path, case):
    entry, field = BAD_MANIFESTS[case]
    put(origin, "v/a.safetensors", 10)
    origin.config["documents"] = {"/v/": {"files": [entry]}}
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError) as exc:
        await asyncio.wait_for(f.fetch(f"{origin.url}/v/"), 20)
    assert not exc.value.retryable, exc.value
    assert "refused" in str(exc.value) and field in str(exc.value)
    assert [e["path"] for e in origin.log()] == ["/v/"]  # nothing fetched, no path built from the name


async def test_a_manifest_with_no_files_or_twice_one_file_is_refused(origin, tmp_path):
    f = Fetcher(tmp_path / "cache", None)
    for files in ([], [{"name": "a.gguf", "size": 1, "sha256": SHA}] * 2):
        origin.config["documents"] = {"/v/": {"files": files}}
        with pytest.raises(FetchError) as exc:
            await f.fetch(f"{origin.url}/v/")
        assert not exc.value.retryable


# ---- limits -------------------------------------------------------------------------------------

async def test_one_byte_at_a_time_times_out(origin, tmp_path):
    """The issue's one byte every 59 s against a 60 s read timeout, scaled: one byte every 0.3 s against
    at least 1 KiB every 1.5 s."""
    put(origin, "slow.gguf", 100_000)
    origin.config["drip"] = {"/slow.gguf": 0.3}
    f = Fetcher(tmp_path / "cache", None, Limits(stall_s=1.5, stall_bytes=1024))
    with pytest.raises(FetchError, match="stalled"):
        await asyncio.wait_for(f.fetch(f"{origin.url}/slow.gguf"), 30)


async def test_an_attempt_has_an_overall_deadline(origin, tmp_path):
    put(origin, "steady.gguf", 2_000_000)
    origin.config["rate"] = 200_000  # steady, never stalled, but 10 s long
    f = Fetcher(tmp_path / "cache", None, Limits(deadline_s=1.5, stall_s=60, stall_bytes=1))
    with pytest.raises(FetchError, match="deadline"):
        await asyncio.wait_for(f.fetch(f"{origin.url}/steady.gguf"), 30)


async def test_a_file_over_the_size_cap_is_refused_and_leaves_nothing(origin, tmp_path):
    put(origin, "huge.gguf", 50_000)
    f = Fetcher(tmp_path / "cache", None, Limits(max_bytes=10_000))
    with pytest.raises(FetchError, match="over the limit") as exc:
        await f.fetch(f"{origin.url}/huge.gguf")
    assert not exc.value.retryable
    assert not [p for p in (tmp_path / "cache" / ".partial").iterdir() if p.suffix == ".part"]


async def test_a_web_page_is_not_weights(origin, tmp_path):
    origin.config["html"] = ["/org/model"]
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError, match="web page") as exc:
        await f.fetch(f"{origin.url}/org/model")
    assert not exc.value.retryable


# ---- where a mirror fetch may go ---------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "2130706433", "0x7f.1", "017700000001", "[::ffff:127.0.0.1]",
                                  "[::ffff:7f00:1]", "localhost", "[::1]", "0.0.0.0", "[::]"])
async def test_loopback_in_any_form_is_refused_without_the_setting(origin, tmp_path, host):
    put(origin, "w.gguf", 1000)
    url = f"http://{host}:{origin.port}/w.gguf"
    with pytest.raises(FetchError) as exc:
        await download(url, tmp_path / "w.gguf", tmp_path, policy=AddressPolicy())
    assert not exc.value.retryable
    assert "LLMGW_MIRROR_PRIVATE_SOURCES" in str(exc.value) or "not a unicast" in str(exc.value)
    assert origin.log() == []  # refused before connecting
    assert not list(tmp_path.glob("w.gguf*"))  # and nothing left behind


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/x",
                                 "http://[::ffff:169.254.169.254]/x", "http://10.0.0.1/x", "http://192.168.1.1/x",
                                 "http://100.64.0.1/x", "http://[fd00::1]/x", "http://224.0.0.1/x"])
async def test_private_and_metadata_addresses_are_refused(tmp_path, url):
    policy = AddressPolicy.parse("127.0.0.0/8")  # a private mirror allowed, but not these
    with pytest.raises(FetchError) as exc:
        await asyncio.wait_for(download(url, tmp_path / "x", tmp_path, policy=policy), 5)
    assert not exc.value.retryable


@pytest.mark.parametrize("host,address,suggested", [
    ("[fd00::1]", "fd00::1", "fd00::1/128"),
    ("[fec0::1]", "fec0::1", "fec0::1/128"),  # deprecated site-local: private, not global
    ("[fec0:1::5]", "fec0:1::5", "fec0:1::5/128"),
    ("10.1.2.3", "10.1.2.3", "10.1.2.3/32"),
])
async def test_a_private_source_is_refused_with_a_suggestion_of_its_own_address_only(tmp_path, host, address, suggested):
    """Issue 36: an IPv6 private address got a `/32` suggestion (a quarter of all IPv6 space around it),
    and fec0::/10 passed as global."""
    with pytest.raises(FetchError) as exc:
        await asyncio.wait_for(download(f"http://{host}/x", tmp_path / "x", tmp_path, policy=AddressPolicy()), 5)
    assert not exc.value.retryable and f"LLMGW_MIRROR_PRIVATE_SOURCES={suggested}," in str(exc.value), str(exc.value)
    assert AddressPolicy.parse(suggested).refusal(ipaddress.ip_address(address)) is None  # the suggestion works


async def test_link_local_is_refused_even_when_private_sources_are_allowed(tmp_path):
    policy = AddressPolicy.parse("private,169.254.0.0/16")
    with pytest.raises(FetchError, match="link-local"):
        await download("http://169.254.169.254/latest/meta-data/", tmp_path / "x", tmp_path, policy=policy)


@pytest.mark.parametrize("location,why", [
    ("http://127.0.0.2:{port}/w.gguf", "LLMGW_MIRROR_PRIVATE_SOURCES"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("ftp://127.0.0.1/w.gguf", "only http"),
    ("/loop", "redirects"),
])
async def test_redirects_are_followed_only_within_the_policy(origin, tmp_path, location, why):
    put(origin, "w.gguf", 1000)
    origin.config["redirect"] = {"/start": location.format(port=origin.port), "/loop": "/loop"}
    policy = AddressPolicy.parse("127.0.0.1/32")
    with pytest.raises(FetchError, match=why):
        await download(f"{origin.url}/start", tmp_path / "w.gguf", tmp_path, policy=policy)
    assert not (tmp_path / "w.gguf").exists()
    assert all(e["path"] != "/w.gguf" for e in origin.log())


async def test_a_redirect_within_the_policy_is_followed(origin, tmp_path):
    data = put(origin, "w.gguf", 1000)
    origin.config["redirect"] = {"/start": "/w.gguf"}
    policy = AddressPolicy.parse("127.0.0.1")
    async with target_lock(tmp_path, tmp_path / "w.gguf"):
        got = await download(f"{origin.url}/start", tmp_path / "w.gguf", tmp_path, policy=policy)
    assert got.size == 1000 and (tmp_path / "w.gguf").read_bytes() == data


# ---- secrets in source URLs --------------------------------------------------------------------------

async def test_signed_tokens_never_reach_errors_or_logs(origin, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    put(origin, "ok.gguf", 1000)
    f = Fetcher(tmp_path / "cache", None)
    secret = "X-Amz-Signature=SECRET0123456789"
    with pytest.raises(FetchError) as exc:
        await f.fetch(f"{origin.url}/missing.gguf?{secret}")
    got = await f.fetch(f"http://user:PASSWORD42@127.0.0.1:{origin.port}/ok.gguf?{secret}")
    assert got.fetched
    text = str(exc.value) + caplog.text
    assert "SECRET0123456789" not in text and "PASSWORD42" not in text
    assert "missing.gguf?<redacted>" in str(exc.value)
    assert redact("https://u:p@h:8443/a/b?sig=1#f") == "https://h:8443/a/b?<redacted>"



# ---- bodies that do not say how long they are ------------------------------------------------------

async def test_a_body_with_no_length_cut_half_way_is_never_taken_for_the_file(origin, tmp_path):
    """No Content-Length, not chunked: the body ends when the connection closes, and so does a cut one.
    Before, the half file was cached (and, in the mirror, published with its sha256 recorded). Now the end
    is confirmed by asking for the bytes after it: the cut download resumes, and a whole one is confirmed
    by the server's 416."""
    data = put(origin, "n.gguf", 1_000_000)
    whole = put(origin, "w.gguf", 300_000)
    origin.config["no_length"] = ["/n.gguf", "/w.gguf"]
    origin.config["drop"] = {"/n.gguf": 400_000}
    f = Fetcher(tmp_path / "cache", None)
    got = await fetch_with_retries(f, f"{origin.url}/n.gguf")
    assert Path(got.path).read_bytes() == data
    assert [(e["status"], e["range"]) for e in origin.log("/n.gguf")][:2] == [(200, None), (206, "bytes=400000-")]
    got = await f.fetch(f"{origin.url}/w.gguf")
    assert Path(got.path).read_bytes() == whole
    assert [e["status"] for e in origin.log("/w.gguf")] == [200, 416, 206]  # (the last asks for its declared sha256)


async def test_a_body_with_no_length_from_a_server_that_ignores_ranges_is_refused(origin, tmp_path):
    put(origin, "r.gguf", 200_000)
    origin.config["no_length"] = ["/r.gguf"]
    origin.config["ignore_range"] = ["/r.gguf"]
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError, match="states no length for it and does not confirm one") as exc:
        await f.fetch(f"{origin.url}/r.gguf")
    assert not exc.value.retryable
    assert not [p for p in (tmp_path / "cache").rglob("r.gguf")]


async def test_a_whole_length_partial_is_checked_against_the_sha256_the_server_declares(origin, tmp_path):
    """A partial as long as the file but with wrong bytes (a torn write, an older file): the 416 that says
    it is complete carries no sha256, so it had been cached unchecked. Now the declared sha256 (the
    mirror's `X-Llmgw-Sha256`) is asked for and compared; the file is fetched again, right."""
    data = put(origin, "t.gguf", 100_000)
    origin.config["declare_sha"] = ["/t.gguf"]
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.gguf.0123456789ab.part").write_bytes(b"\0" * 100_000)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        await download(f"{origin.url}/t.gguf", work / "t.gguf", work)
    assert not (work / "t.gguf").exists()
    got = await download(f"{origin.url}/t.gguf", work / "t.gguf", work)
    assert (work / "t.gguf").read_bytes() == data and got.sha256 == hashlib.sha256(data).hexdigest()


async def test_headers_dripped_a_byte_at_a_time_are_cut_off(origin, tmp_path):
    """The stall limit held only once the body began: a server sending its status line and headers a byte
    a second kept the fetch "connecting" without end (its activity heartbeating all along)."""
    put(origin, "h.gguf", 10)
    origin.config["drip_head"] = {"/h.gguf": 0.3}
    f = Fetcher(tmp_path / "cache", None, Limits(stall_s=1.5, stall_bytes=1))
    with pytest.raises(FetchError, match="no answer within"):
        await asyncio.wait_for(f.fetch(f"{origin.url}/h.gguf"), 10)


@pytest.mark.parametrize("host", ["a..b", "x" * 300 + ".example"])
async def test_a_host_name_that_cannot_be_one_is_refused_in_words(tmp_path, host):
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError, match="is not a host name") as exc:
        await f.fetch(f"http://{host}/m.gguf")
    assert not exc.value.retryable


async def test_a_full_disk_removes_the_partial_and_says_so_once(origin, tmp_path, monkeypatch):
    """ENOSPC mid-download: the partial had been kept for a retry that fails the same way, holding the full
    disk, so every other fetch on it failed too ("needs N more bytes but ... has 0 free"). Now it is
    removed and the failure is final, saying what to do. (The disk is the one part replaced here.)"""
    import errno

    from llmgw.weights import download as dl

    put(origin, "big.gguf", 3_000_000)
    real = dl._write_all
    written = [0]

    def full(fd, view):
        if written[0] > 1_000_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(view)
        real(fd, view)

    monkeypatch.setattr(dl, "_write_all", full)
    f = Fetcher(tmp_path / "cache", None)
    with pytest.raises(FetchError, match="is full") as exc:
        await f.fetch(f"{origin.url}/big.gguf")
    assert not exc.value.retryable and "reclaim" in str(exc.value)
    assert not [p for p in (tmp_path / "cache").rglob("*.part")]


async def test_a_cache_emptied_while_the_agent_runs_is_made_again(origin, tmp_path):
    """An operator removes the whole cache directory under a running agent: the next fetch recreates it (it had
    failed on its lock file, `No such file or directory`, until the agent restarted)."""
    import shutil

    data = put(origin, "one.gguf", 100_000)
    f = Fetcher(tmp_path / "cache", None)
    first = await f.fetch(f"{origin.url}/one.gguf")
    shutil.rmtree(tmp_path / "cache")
    assert f.cached_names() == []  # what the agent's heartbeat reports meanwhile, instead of failing
    again = await f.fetch(f"{origin.url}/one.gguf")
    assert again.fetched and Path(again.path).read_bytes() == data and again.path == first.path
