"""The explorer's rules (pure parts, and probing a real HTTP origin), the mirror's "whole or not ready",
and publishing from staging: fast tests, no Temporal. The workflow around them is in
test_mirror_workflow.py."""

from __future__ import annotations

import json
import struct
import threading

import httpx
import pytest
import uvicorn

from llmgw.dev.procs import free_port, wait_port
from llmgw.schemas.mirror import ExploreInput, MirroredFile, MirrorProgress, MirrorState, PublishInput
from llmgw.mirror.explorer import ExploreError, Explorer, canonical_sources, default_name, version_of, web_page_hint
from llmgw.weights.manifest import check_weights_file, file_sha256, missing_parts
from llmgw.mirror.server import create_mirror_app
from llmgw.weights.naming import SourceError, check_mirror_name
from llmgw.mirror.staging import PublishError, open_staging, publish, published_version, staging_dir
from llmgw.weights.urls import AddressPolicy
from tests.origin_server import Origin


def safetensors(n: int) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\1" * n


@pytest.mark.parametrize("url,instead", [
    ("https://huggingface.co/Qwen/Qwen2.5-7B-Instruct", "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/resolve/main/"),
    ("https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/tree/main", "/resolve/main/"),
    ("https://hf.co/org/m/blob/v1/m-Q4.gguf", "https://huggingface.co/org/m/resolve/v1/m-Q4.gguf"),
])
def test_repository_pages_are_refused_with_what_to_write(url, instead):
    hint = web_page_hint(url)
    assert hint and instead in hint


@pytest.mark.parametrize("url", ["https://huggingface.co/org/m/resolve/main/", "https://example.com/org/m",
                                 "https://huggingface.co/datasets/org/d"])
def test_file_urls_are_not_pages(url):
    assert web_page_hint(url) is None


def test_a_split_gguf_is_one_version_whichever_part_is_given():
    part2 = ["https://h/x/big-00002-of-00003.gguf?sig=1"]
    every = canonical_sources(part2)
    assert [u.split("/")[-1] for u in every] == [f"big-0000{i}-of-00003.gguf?sig=1" for i in (1, 2, 3)]
    assert default_name(part2) == "big"
    assert version_of(part2) == version_of(["https://h/x/big-00001-of-00003.gguf?sig=2"])  # tokens differ


def test_names_and_versions_of_sources():
    assert default_name(["https://huggingface.co/org/Model-7B/resolve/main/"]) == "Model-7B"
    assert default_name(["http://files/weights/qwen-7b/"]) == "qwen-7b"
    assert default_name(["http://files/x/m.Q4_K_M.gguf"]) == "m.Q4_K_M.gguf"
    with pytest.raises(ExploreError, match="--name"):
        default_name(["http://h/a.gguf", "http://h/b.gguf"])
    assert version_of(["http://h/a/"]) != version_of(["http://h/b/"])
    assert version_of(["http://u:p@h/a/?t=1"]) == version_of(["http://h/a/"])


@pytest.mark.parametrize("name", ["a.gguf\n", "a\u2024gguf", "x\uff0fy", "../x", "a//b", ".hidden", "a b", "", "/"])
def test_mirror_names_that_are_not_plain_are_refused(name):
    with pytest.raises(SourceError):
        check_mirror_name(name)


def test_whole_sets():
    assert missing_parts({"a-00001-of-00003.gguf", "a-00003-of-00003.gguf"}, None) == ["a-00002-of-00003.gguf"]
    assert missing_parts({"x.safetensors"}, ["x.safetensors", "y.safetensors"]) == ["y.safetensors"]
    assert missing_parts({"m.gguf"}, None) == []


def test_a_truncated_safetensors_file_is_not_whole(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(safetensors(1000))
    assert check_weights_file(good) is None
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(safetensors(1000)[:-10])
    assert "end at byte" in (check_weights_file(bad) or "")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"<html>")
    assert "GGUF magic" in (check_weights_file(gguf) or "")


@pytest.fixture
def origin(tmp_path):
    root = tmp_path / "origin"
    (root / "repo").mkdir(parents=True)
    o = Origin(root, free_port())
    o.root = root  # type: ignore[attr-defined]
    yield o
    o.stop()


async def explore(origin, *sources: str):
    policy = AddressPolicy.parse("127.0.0.1")
    return await Explorer(policy).plan(ExploreInput(name="n", version="v", sources=list(sources)))


async def test_a_layout_is_exactly_what_a_replica_reads(origin):
    repo = origin.root / "repo"
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s1.safetensors"}}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    for n in ("s1.safetensors", "s2.safetensors"):
        (repo / n).write_bytes(safetensors(100))
    for n in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md",
              "model.bin", "s3.safetensors"):
        (repo / n).write_text("{}")
    plan = await explore(origin, f"{origin.url}/repo/")
    assert plan.kind == "version"
    assert sorted(f.name for f in plan.files) == sorted([
        "model.safetensors.index.json", "s1.safetensors", "s2.safetensors", "config.json", "tokenizer.json",
        "tokenizer_config.json", "generation_config.json"])
    assert {f.name: f.size for f in plan.files}["s1.safetensors"] == len(safetensors(100))


async def test_a_layout_without_its_config_or_a_shard_is_refused(origin):
    repo = origin.root / "repo"
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(ExploreError, match="s1.safetensors, named in model.safetensors.index.json, is missing"):
        await explore(origin, f"{origin.url}/repo/")
    (repo / "s1.safetensors").write_bytes(safetensors(10))
    with pytest.raises(ExploreError, match="config.json .vLLM and SGLang need it. is missing"):
        await explore(origin, f"{origin.url}/repo/")
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(ExploreError, match="not allowed"):
        await explore(origin, f"{origin.url}/repo/")
    (repo / "model.safetensors.index.json").unlink()
    with pytest.raises(ExploreError, match="neither"):
        await explore(origin, f"{origin.url}/repo/")


async def test_an_origin_answering_html_is_a_web_page(origin):
    origin.config["html"] = ["/repo/model.gguf"]
    with pytest.raises(ExploreError, match="web page"):
        await explore(origin, f"{origin.url}/repo/model.gguf")


# ---- the mirror answers a version whole, or "not ready yet" ---------------------------------------

@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_mirror_app(root), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_port(port, 10)
    yield root, f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(5)


def test_a_hand_copied_version_missing_a_shard_is_not_ready(mirror):
    root, url = mirror
    v = root / "hand"
    v.mkdir()
    (v / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    (v / "s1.safetensors").write_bytes(safetensors(10))
    r = httpx.get(url + "/files/hand/")
    assert r.status_code == 409 and "s2.safetensors missing" in r.json()["error"]
    (v / "s2.safetensors").write_bytes(safetensors(10))
    assert httpx.get(url + "/files/hand/").status_code == 200


def test_a_version_being_mirrored_is_not_ready_and_its_staging_is_never_served(mirror):
    root, url = mirror
    stage = open_staging(root, "org/model", "v1", "version")
    (stage / "s1.safetensors").write_bytes(safetensors(10))
    r = httpx.get(url + "/files/org/model/")
    assert r.status_code == 409 and "not ready yet" in r.json()["error"]
    listing = httpx.get(url + "/files").json()
    assert listing["files"] == [] and listing["pending"] == ["org/model/"]
    assert httpx.get(url + "/files/.staging/").status_code == 400


def test_publish_is_whole_idempotent_and_never_replaces_a_published_name(tmp_path):
    root = tmp_path / "mirror"
    stage = open_staging(root, "m", "v1", "version")
    data = safetensors(50)
    (stage / "model.safetensors").write_bytes(data)
    (stage / "config.json").write_text("{}")
    files = [MirroredFile(name="model.safetensors", size=len(data), sha256=file_sha256(stage / "model.safetensors")),
             MirroredFile(name="config.json", size=2, sha256=file_sha256(stage / "config.json"))]
    inp = PublishInput(name="m", version="v1", kind="version", files=files)
    short = PublishInput(name="m", version="v1", kind="version", files=[files[0], files[1].model_copy(update={"size": 3})])
    with pytest.raises(PublishError, match="2 bytes, 3 were verified"):
        publish(root, short)
    first = publish(root, inp)
    assert not first.already and first.source == "mirror:m/" and sorted(p.name for p in (root / "m").iterdir()) == [
        ".llmgw-sha256.json", ".llmgw-version", "config.json", "model.safetensors"]
    assert published_version(root, "m/") == (True, "v1") and published_version(root, "n") == (False, None)
    assert not staging_dir(root, "m", "v1").exists()
    assert publish(root, inp).already  # a retry after the first one committed
    other = open_staging(root, "m", "v2", "version")
    (other / "model.safetensors").write_bytes(safetensors(60))
    with pytest.raises(PublishError, match="never changes"):
        publish(root, PublishInput(name="m", version="v2", kind="version", files=[MirroredFile(
            name="model.safetensors", size=len(safetensors(60)), sha256=file_sha256(other / "model.safetensors"))]))


def test_progress_lines():
    p = MirrorProgress(name="m", version="v", state=MirrorState.downloading, files=3, bytes=3 << 30, total=None)
    assert p.line() == "downloading 3.0 GiB so far, 0 of 3 file(s) done"
    p.total = 6 << 30
    assert "3.0 GiB of 6.0 GiB (50%)" in p.line()


def test_the_listing_skips_what_no_one_can_fetch_instead_of_a_500(mirror):
    """A dangling link in the mirror's directory (a file removed by hand) made `GET /files`, the listing
    `llmgw dev` prints, answer 500."""
    root, url = mirror
    (root / "real.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    (root / "gone.gguf").symlink_to(root / "nowhere.gguf")
    r = httpx.get(url + "/files")
    assert r.status_code == 200, r.text
    assert [f["name"] for f in r.json()["files"]] == ["real.gguf"]
    # A link out of the mirror's directory is refused when fetched, so it is not listed (with the size of a
    # file outside the root) either: `ctl apply` read the listing as holding it.
    outside = root.parent / "outside.bin"
    outside.write_bytes(b"x" * 1286)
    (root / "link.gguf").symlink_to(outside)
    assert [f["name"] for f in httpx.get(url + "/files").json()["files"]] == ["real.gguf"]
    assert httpx.get(url + "/files/link.gguf").status_code == 400


async def test_a_file_still_being_mirrored_is_a_retryable_wait_for_a_node(mirror, tmp_path):
    """`mirror:big.gguf` while the mirror stages it answers 409 "not ready yet": a node's fetch of it had
    failed for good (any 4xx), so a replica started a moment early failed its start."""
    from llmgw.weights.download import FetchError
    from llmgw.weights.fetcher import Fetcher

    root, url = mirror
    open_staging(root, "big.gguf", "v1", "file")
    f = Fetcher(tmp_path / "cache", url)
    with pytest.raises(FetchError, match="409") as exc:
        await f.fetch("mirror:big.gguf")
    assert exc.value.retryable


def test_mirror_add_of_a_local_file_never_changes_a_published_name(tmp_path):
    """`llmgw mirror add FILE --name x.gguf` replaced a published x.gguf of another size, and silently kept
    the old one when the size was the same (a size-only check); `--name ver/part.gguf` changed a published
    version. Nodes cache by name, so the fleet would serve different weights under one name."""
    import subprocess
    import sys

    mirror = tmp_path / "mirror"
    first, same_size, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    first.write_bytes(b"GGUF" + b"a" * 100)
    same_size.write_bytes(b"GGUF" + b"b" * 100)
    other.write_bytes(b"GGUF" + b"c" * 50)

    def add(path, name):
        return subprocess.run([sys.executable, "-m", "llmgw", "mirror", "add", str(path), "--name", name,
                               "--dir", str(mirror)], capture_output=True, text=True, timeout=60)

    assert add(first, "x.gguf").returncode == 0
    assert add(first, "x.gguf").returncode == 0  # the same bytes again: kept, no error
    for path in (same_size, other):
        out = add(path, "x.gguf")
        assert out.returncode == 2 and "is published with other bytes" in out.stderr, out
        assert "Traceback" not in out.stderr
    assert (mirror / "x.gguf").read_bytes() == first.read_bytes()
    (mirror / "ver").mkdir()
    (mirror / "ver" / "m-00001-of-00002.gguf").write_bytes(b"GGUF" + b"1" * 10)
    out = add(other, "ver/m-00002-of-00002.gguf")
    assert out.returncode == 2 and "mirror:ver/ is published already" in out.stderr, out
    assert not (mirror / "ver" / "m-00002-of-00002.gguf").exists()
