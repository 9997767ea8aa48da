"""Compile caches per key (issue 39, item 3): the key, its directory, one writer at a time, the bound.

The real path (an agent launching an engine with the directory, a second start of the key reusing it) is
tests/test_compile_cache_e2e.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from llmgw.engines.base import ShardSpec
from llmgw.engines.compile_cache import CompileKey, dist_version, script_python, slug, weights_identity
from llmgw.engines.sglang import SglangAdapter
from llmgw.engines.sim import SimAdapter
from llmgw.engines.vllm import VllmAdapter
from llmgw.node import compile_dirs
from llmgw.node.compile_dirs import held, mark_warm, open_compile_dir, trim
from llmgw.schemas.catalog import Profile

KEY = CompileKey(engine="vllm", engine_version="0.32.0+cpu", weights="0123abcd-model", tp=1, pp=1,
                 accelerator="NVIDIA H100 80GB HBM3")


def test_the_key_changes_with_each_component_and_is_stable_otherwise():
    assert CompileKey(**dataclasses.asdict(KEY)).name == KEY.name  # the same components, the same name
    changes = {"engine": "sglang", "engine_version": "0.32.1", "weights": "other", "tp": 2, "pp": 2,
               "accelerator": "NVIDIA H200"}
    names = {KEY.name}
    for field, value in changes.items():
        other = dataclasses.replace(KEY, **{field: value})
        assert other.name != KEY.name, field
        names.add(other.name)
    assert len(names) == len(changes) + 1
    # Components that slug alike are still told apart by the digest.
    a = dataclasses.replace(KEY, accelerator="NVIDIA A100")
    b = dataclasses.replace(KEY, accelerator="nvidia a100")
    assert slug(a.accelerator) == slug(b.accelerator) and a.name != b.name


@pytest.mark.parametrize("hostile", ["../../etc", "/abs/path", ".", "..", ".hidden", "a/b\\c", "x" * 5000,
                                     "\x00\n\t", "名前", "-rf", ""])
def test_a_name_is_one_safe_path_component_whatever_the_components_hold(hostile, tmp_path):
    key = CompileKey(engine=hostile, engine_version=hostile, weights=hostile, accelerator=hostile)
    name = key.name
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert name not in (".", "..") and not name.startswith((".", "-"))
    assert len(name.encode()) < 255 and name.isascii()
    d = open_compile_dir(tmp_path, key, "shard/../x")
    try:
        assert d.path.parent == tmp_path / ".compile" and d.path.is_dir()  # made where it belongs, nowhere else
    finally:
        d.release()


def test_weights_are_named_by_their_cache_entry_or_as_given(tmp_path):
    entry = tmp_path / "3f9a0c1d2e3f4a5b6c7d8e9f0a1b2c3d-smollm2"
    entry.mkdir()
    (entry / "model.gguf").write_text("x")
    assert weights_identity(tmp_path, str(entry)) == entry.name
    assert weights_identity(tmp_path, str(entry / "model.gguf")) == entry.name  # a file in a version directory
    assert weights_identity(tmp_path, "Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a model id, passed as given
    assert weights_identity(tmp_path, None) == ""


def test_each_adapter_points_its_engine_at_the_directory(tmp_path):
    spec = ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=Profile(engine="sim", source="/w"),
                     weights_path="/w", port=1234, compile_dir=str(tmp_path))
    assert SimAdapter().build(spec).env["LLMGW_SIM_COMPILE_DIR"] == str(tmp_path)
    assert SglangAdapter().build(dataclasses.replace(spec, profile=Profile(engine="sglang", source="/w"))).env[
        "SGLANG_CACHE_DIR"] == str(tmp_path)
    vllm = VllmAdapter(vllm="/nonexistent/vllm")
    env = vllm.build(dataclasses.replace(spec, profile=Profile(engine="vllm", source="/w"))).env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path)
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path)) and env["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    assert "VLLM_USE_AOT_COMPILE" not in env  # on GPUs vLLM's own compile path is left alone
    cpu = vllm.build(dataclasses.replace(spec, profile=Profile(engine="vllm", source="/w", device="cpu",
                                                                memory_gb=4))).env
    assert cpu["VLLM_USE_AOT_COMPILE"] == "0"  # the CPU build's AOT artifact does not load (bench/README.md)
    # No directory: the engine's own default, no variable at all.
    assert "VLLM_CACHE_ROOT" not in vllm.build(dataclasses.replace(
        spec, compile_dir=None, profile=Profile(engine="vllm", source="/w"))).env


def test_an_engines_version_is_read_from_its_python_without_importing_it(tmp_path):
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable}\n")
    assert script_python(str(script)) == sys.executable
    assert dist_version(sys.executable, "pytest") == pytest.__version__
    assert dist_version(sys.executable, "no-such-distribution-here") == ""
    assert script_python(str(tmp_path / "missing")) is None


def test_one_writer_per_key_a_second_shard_gets_a_scratch_copy_once_the_key_is_warm(tmp_path):
    first = open_compile_dir(tmp_path, KEY, "a-r0")
    assert first.shared and held(first.path)
    (first.path / "artifact").write_text("compiled")
    cold = open_compile_dir(tmp_path, KEY, "b-r0")  # the key is held and not yet warm: an empty scratch
    assert not cold.shared and cold.path != first.path and not (cold.path / "artifact").exists()
    cold.release()
    mark_warm(first.path)
    warm = open_compile_dir(tmp_path, KEY, "c-r0")  # held and warm: a copy of it
    assert not warm.shared and (warm.path / "artifact").read_text() == "compiled"
    warm.release()
    first.release()
    assert not held(first.path)
    again = open_compile_dir(tmp_path, KEY, "d-r0")  # free again: the key's own directory, reused
    assert again.shared and again.path == first.path and (again.path / "artifact").exists()
    (again.path / "half-written").write_text("{")
    again.release()  # ... by an engine that never became ready (no mark_warm): what it left is not trusted
    last = open_compile_dir(tmp_path, KEY, "e-r0")
    assert last.path == first.path and not (last.path / "half-written").exists()
    assert not (last.path / "artifact").exists() and (last.path / "key.json").exists()
    last.release()


def test_the_lock_lives_as_long_as_the_engine_that_inherited_it(tmp_path):
    d = open_compile_dir(tmp_path, KEY, "a-r0")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                            pass_fds=(d.fd,))
    try:
        d.release()  # the node worker lets go; the engine still holds it
        assert held(d.path)
        assert not open_compile_dir(tmp_path, KEY, "b-r0").shared
    finally:
        proc.communicate(b"")
    assert not held(d.path)  # the engine ended: free


def test_trim_removes_the_least_recently_used_keys_never_a_held_one_and_free_scratch(tmp_path):
    keys = [dataclasses.replace(KEY, weights=f"w{i}") for i in range(4)]
    dirs = []
    for i, k in enumerate(keys):
        d = open_compile_dir(tmp_path, k, f"s{i}")
        (d.path / "blob").write_bytes(b"x" * 1000)
        os.utime(d.path / ".used", (1000 + i, 1000 + i))  # w0 used longest ago
        dirs.append(d)
    for d in dirs[1:]:
        d.release()
    scratch = open_compile_dir(tmp_path, keys[0], "other")  # w0 is held: a scratch directory
    scratch.release()
    removed = trim(tmp_path, 2500)  # room for two
    assert f".scratch/{scratch.path.name}" in removed and not scratch.path.exists()
    # w0 is the oldest but held: w1 and w2 go, w3 (the newest) stays.
    assert [n for n in removed if not n.startswith(".scratch")] == [keys[1].name, keys[2].name]
    assert dirs[0].path.exists() and dirs[3].path.exists()
    dirs[0].release()
    assert trim(tmp_path, 0) == [keys[0].name, keys[3].name]  # free now: oldest use first


def test_the_accelerator_kind_is_cpu_without_gpus(monkeypatch):
    assert compile_dirs.accelerator_kind([]) == "cpu"
    monkeypatch.setattr(compile_dirs, "_gpu_names", lambda: ("NVIDIA H100 80GB HBM3", "NVIDIA L4"))
    assert compile_dirs.accelerator_kind([0]) == "NVIDIA H100 80GB HBM3"
    assert compile_dirs.accelerator_kind([0, 1]) == "NVIDIA H100 80GB HBM3+NVIDIA L4"
    monkeypatch.setattr(compile_dirs, "_gpu_names", lambda: ())
    assert compile_dirs.accelerator_kind([3]) == "gpu"  # a simulated node: NVML has nothing to say


def test_reclaim_takes_the_compile_caches_of_weights_no_longer_wanted_never_a_held_one(tmp_path):
    from llmgw.node.reclaim import reclaim

    gone, kept, busy = ("0" * 32 + "-gone", "1" * 32 + "-kept", "2" * 32 + "-busy")
    dirs = {w: open_compile_dir(tmp_path, dataclasses.replace(KEY, weights=w), w) for w in (gone, kept, busy)}
    other = open_compile_dir(tmp_path, dataclasses.replace(KEY, weights="Qwen/Qwen3-8B"), "x")  # not llmgw's
    for w in (gone, kept):
        dirs[w].release()
    other.release()
    listed = reclaim("n", tmp_path, {kept}, set(), collect=False)
    assert listed.unwanted == [f".compile/{dirs[gone].path.name}"] and not listed.removed
    assert listed.kept_in_use == [f".compile/{dirs[busy].path.name}"]
    assert ".compile" not in listed.ignored  # hidden from the weights' scan: never judged as weights
    out = reclaim("n", tmp_path, {kept}, set(), collect=True)
    assert out.removed == [f".compile/{dirs[gone].path.name}"] and not dirs[gone].path.exists()
    assert dirs[kept].path.exists() and dirs[busy].path.exists() and other.path.exists()
    dirs[busy].release()
