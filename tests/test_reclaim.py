"""Reclaiming cached weights through a ReclaimWorkflow and the real node worker: only files llmgw fetched
and the catalog no longer wants; listing by default, deleting with collect; files put there by hand are
never touched; a path trying to leave the cache is refused by the node itself."""

from __future__ import annotations

import httpx
import pytest

from llmgw.node.reclaim import reclaim
from llmgw.weights.naming import cache_name_for
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def test_reclaim_lists_then_collects_only_what_llmgw_fetched(control_plane):
    cp = control_plane.start(mirror=True)
    (cp.mirror_dir / "keep.gguf").write_bytes(b"k" * 1000)
    agent = cp.agent("n1")
    wait_until(lambda: "registered node n1" in agent.log(), timeout_s=30, what="agent registered")
    catalog = {"models": [{"name": "keep", "scaling": {"min": 0, "max": 1},
                           "profiles": [{"engine": "llamacpp", "source": "mirror:keep.gguf"}]}]}
    assert cp.apply(catalog).status_code == 200
    cache = cp.state / "cache" / "n1"  # the agent's LLMGW_CACHE_DIR in the test harness
    old = cache / cache_name_for("mirror:old-model.gguf")
    old.write_bytes(b"o" * 2_000_000)
    wanted = cache / cache_name_for("mirror:keep.gguf")
    wanted.write_bytes(b"k" * 1000)
    by_hand = cache / "copied-by-operator.gguf"
    by_hand.write_bytes(b"h")

    listed = httpx.post(cp.admin + "/admin/v1/reclaim", json={"collect": False}, timeout=120, headers=cp.admin_headers).json()
    [n] = listed["nodes"]
    assert n["unwanted"] == [old.name] and n["removed"] == []
    assert "copied-by-operator.gguf" in n["ignored"]
    assert old.exists()

    collected = httpx.post(cp.admin + "/admin/v1/reclaim", json={"collect": True}, timeout=120, headers=cp.admin_headers).json()
    [n] = collected["nodes"]
    assert n["removed"] == [old.name] and n["freed_mb"] == 1
    assert not old.exists() and wanted.exists() and by_hand.exists()


def test_node_never_follows_a_link_out_of_its_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"x")
    (cache / cache_name_for("mirror:evil.gguf")).symlink_to(outside)
    r = reclaim("n1", cache, wanted=set(), in_use=set(), collect=True)
    assert r.removed == [] and outside.exists()
    in_use = cache / cache_name_for("mirror:busy.gguf")
    in_use.write_bytes(b"b")
    r = reclaim("n1", cache, wanted=set(), in_use={str(in_use)}, collect=True)
    assert r.kept_in_use == [in_use.name] and in_use.exists()


def test_weights_in_use_are_kept_when_the_cache_is_reached_through_a_symlink(tmp_path):
    # The fetcher names weights `cache_dir / name` as configured; the entries are resolved. A cache dir
    # that is a symlink (a volume mounted elsewhere) must not make a running shard's weights look unused.
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    cache = tmp_path / "cache"
    cache.symlink_to(real)
    busy = cache / cache_name_for("mirror:busy.gguf")
    busy.write_bytes(b"b")
    version = cache / cache_name_for("mirror:org/model/")
    version.mkdir()
    (version / "model.gguf").write_bytes(b"v")
    r = reclaim("n1", cache, wanted=set(), in_use={str(busy), str(version / "model.gguf")}, collect=True)
    assert sorted(r.kept_in_use) == sorted([busy.name, version.name]) and r.removed == [], r
    assert busy.exists() and (version / "model.gguf").exists()


def test_weights_a_start_just_fetched_are_not_reclaimed_before_its_engine_holds_them(control_plane, tmp_path):
    """Between a start's fetch and its launch (an await; a workflow step on the two-step path) no engine
    holds the weights yet, and only running shards counted as in use: a source that had just left the
    catalog could be deleted under the launch. Here the engine never holds them (it exits at once), the
    model leaves the catalog, and a collecting reclaim keeps what the start fetched a moment ago."""
    cp = control_plane.start(mirror=True)
    (cp.mirror_dir / "fresh.gguf").write_bytes(b"GGUF" + b"f" * 1000)
    dies = tmp_path / "llama-server"
    dies.write_text("#!/bin/sh\nexit 1\n")
    dies.chmod(0o755)
    agent = cp.agent("n1", LLMGW_LLAMA_SERVER=str(dies))
    wait_until(lambda: "registered node n1" in agent.log(), timeout_s=30, what="agent registered")
    catalog = {"models": [{"name": "fresh", "scaling": {"min": 1, "max": 1},
                           "profiles": [{"engine": "llamacpp", "source": "mirror:fresh.gguf", "memory_gb": 0.1}]}]}
    assert cp.apply(catalog).status_code == 200
    fetched = cp.state / "cache" / "n1" / cache_name_for("mirror:fresh.gguf")
    wait_until(fetched.exists, timeout_s=60, what="the weights fetched", why=cp.logs)
    assert cp.apply({"models": []}).status_code == 200
    collected = httpx.post(cp.admin + "/admin/v1/reclaim", json={"collect": True}, timeout=120, headers=cp.admin_headers).json()
    [n] = collected["nodes"]
    assert n["kept_in_use"] == [fetched.name] and n["removed"] == [], n
    assert fetched.exists()
