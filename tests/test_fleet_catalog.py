"""The catalog through the real path: `llmgw ctl apply` shows the diff and the upgrade repairs before it
acts; the repairs reach what is stored and what placement uses; a catalog already stored by an older
llmgw is repaired when read; a bad catalog is refused whole, with an error naming the field."""

from __future__ import annotations

import json
import os
import time

import httpx
import psycopg
import pytest
import yaml

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CATALOG = {"models": [
    {"name": "gguf", "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "llamacpp", "source": "mirror:m.gguf", "tp": 2}]},
    {"name": "hub", "scaling": {"min": 0, "max": 1},
     "profiles": [{"engine": "vllm", "source": "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct", "tp": 1}]},
    {"name": "parked", "profiles": [{"engine": "sim"}]},  # no scaling: off
]}


def test_ctl_apply_shows_repairs_and_diff_and_the_repairs_reach_placement(control_plane, tmp_path, database_url):
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=1))
    [node] = [n for n in cp.wait_nodes("node-a") if n["id"] == "node-a"]
    f = tmp_path / "catalog.yaml"
    f.write_text(yaml.safe_dump(CATALOG))

    out = cp.ctl("apply", "-f", str(f), "--yes")
    assert out.returncode == 0, out.stderr
    assert "repaired: models[0] (gguf).profiles[0] (default).tp: read as gpus_per_node: 2" in out.stdout
    assert ("repaired: models[1] (hub).profiles[0] (default).source: the repository page "
            "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct is read as the repository id Qwen/Qwen2.5-0.5B-Instruct") in out.stdout
    assert "  + gguf" in out.stdout and "  + hub" in out.stdout and out.stdout.rstrip().endswith("applied")
    # A model without scaling is off: accepted, and said so with what to write (only of that one).
    assert ("  note: parked has no `scaling`, so it is off and does not run: write `scaling: {max: 1}` to load "
            "it on demand, or `{min: 1, max: 1}` to keep one replica running") in out.stdout
    assert out.stdout.count("so it is off") == 1
    # This control plane runs no mirror: its `mirror:` source is said to be unchecked, not silently passed.
    assert "  note: could not ask the mirror at http://127.0.0.1:" in out.stdout
    assert out.stdout.count("  note: ") == 2
    stored = httpx.get(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers).json()["models"]
    assert stored[0]["profiles"][0] == {"engine": "llamacpp", "source": "mirror:m.gguf", "gpus_per_node": 2}
    assert stored[1]["profiles"][0]["source"] == "Qwen/Qwen2.5-0.5B-Instruct"

    # Placement uses the repaired width: two GPUs wanted, the node has one.
    if "llamacpp" in node["inventory"]["engines"]:
        wait_until(lambda: any("default on node-a: needs 2 free GPU(s), 1 of 1 free" in line
                               for line in cp.explain("gguf")["decisions"]), timeout_s=20, what="gguf refused for GPUs")

    # A change shows field by field; an unchanged apply says so.
    CATALOG["models"][1]["scaling"]["max"] = 2
    f.write_text(yaml.safe_dump(CATALOG))
    out = cp.ctl("apply", "-f", str(f), "--yes")
    assert "  ~ hub\n      scaling.max: 1 -> 2" in out.stdout, out.stdout
    assert "no changes" in cp.ctl("apply", "-f", str(f), "--yes").stdout

    # What an older llmgw stored is repaired when read.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES (%s, %s, %s)",
                     ("old", 9, json.dumps({"name": "old", "profiles": [
                         {"engine": "llamacpp", "source": "mirror:old.gguf", "tp": 4}]})))
    stored = httpx.get(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers).json()["models"]
    assert stored[-1]["profiles"][0] == {"engine": "llamacpp", "source": "mirror:old.gguf", "gpus_per_node": 4}


def test_a_bad_catalog_is_refused_whole_naming_the_field(control_plane, tmp_path):
    cp = control_plane.start()
    good = {"models": [{"name": "small", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]}]}
    assert cp.apply(good).status_code == 200

    bad = {"models": [*good["models"], {"name": "big", "fallbacks": ["smal"], "scaling": {"min": 1, "max": 1},
                                        "profiles": [{"engine": "sim", "tp": 3, "nodes": 2}]}]}
    r = cp.apply(bad)
    assert r.status_code == 400
    problems = r.json()["error"]["problems"]
    assert "models[1] (big).fallbacks: no model or alias named 'smal'; did you mean 'small'?" in problems
    assert any(p.startswith("models[1] (big).profiles[0] (default).nodes: tp × pp = 3 GPUs do not split evenly") for p in problems)

    # Switched off, it says so in the diff and in the live catalog (it read `scaling: {}` and `-> (unset)`).
    off = {"models": [{**good["models"][0], "scaling": {"min": 0, "max": 0}}]}
    r = cp.apply(off)
    assert r.status_code == 200 and r.json()["changes"]["small"] == ["scaling.max: 1 -> 0"], r.json()
    live = httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json()
    assert live["models"][0]["scaling"] == {"min": 0, "max": 0}, live
    assert cp.apply(good).status_code == 200
    # No `scaling` at all: off too, said in the diff of a model added or changed so (issue 44).
    bare = {k: v for k, v in good["models"][0].items() if k != "scaling"}
    r = cp.apply({"models": [bare, {**bare, "name": "new"}]})
    assert r.status_code == 200 and r.json()["changes"] == {
        "small": ["scaling: min 0, max 1 -> (none): off, it does not run; write `scaling: {max: 1}` to load it on demand"],
        "new": ["scaling: (none): off, it does not run; write `scaling: {max: 1}` to load it on demand"]}, r.json()
    assert cp.apply(good).status_code == 200

    # `scaling: on` as YAML reads it: told what to write.
    r = cp.apply({"models": [{**good["models"][0], "scaling": True}]})
    assert r.status_code == 400 and "scaling: must be a mapping of fields (min, max" in r.json()["error"]["problems"][0]
    assert "for example `scaling: {min: 1, max: 1}`" in r.json()["error"]["problems"][0], r.json()

    # A number that is not one, in an engine flag: llama-server read `4O96` as 4.
    r = cp.apply({"models": [{**good["models"][0], "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "5O"]}]}]})
    assert r.status_code == 400 and "--tokens-per-second takes a number, not '5O'" in r.json()["error"]["problems"][0]
    # A context no model has (llama-server grew to 10 GB holding its KV cache): told the bounds.
    big = {"engine": "llamacpp", "source": "mirror:g.gguf", "args": ["--ctx-size", "999999999"]}
    r = cp.apply({"models": [{**good["models"][0], "profiles": [big]}]})
    assert r.status_code == 400, r.text
    assert "--ctx-size is a context length in tokens, from 0 to 16777216" in r.json()["error"]["problems"][0], r.json()

    # A shape error in one model and a cross-catalog error in another come in the same answer.
    mixed = {"models": [{**good["models"][0], "scaling": {"min": 0, "mx": 1}}, bad["models"][1]]}
    problems = cp.apply(mixed).json()["error"]["problems"]
    assert problems[0] == "models[0] (small).scaling.mx: unknown field; did you mean 'max'?", problems
    assert "models[1] (big).fallbacks: no model or alias named 'smal'; did you mean 'small'?" in problems

    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"models": [{"name": "g", "profiles": [
        {"engine": "llamacpp", "source": "mirror:g.gguf", "tp": 2, "nodes": 2}]}]}))
    out = cp.ctl("apply", "-f", str(f), "--yes")
    assert out.returncode == 2
    assert "models[0] (g).profiles[0] (default).nodes: llama.cpp runs a replica on one node; remove `nodes`" in out.stderr
    assert [m["name"] for m in httpx.get(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers).json()["models"]] == ["small"]


def test_a_stored_profile_too_big_to_travel_does_not_wedge_the_reconciler(control_plane, database_url):
    """A profile written around the admin API (SQL, an older llmgw) with a 3 MiB flag: every reconcile
    pass had failed to return its result (Temporal's 2 MiB payload limit), so no other model was ever
    placed. It is left out when read, and said so; the model after it is placed and served."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        for i, spec in enumerate([
                {"name": "huge", "scaling": {"min": 1, "max": 1},
                 "profiles": [{"engine": "sim", "args": ["--x", "a" * (3 << 20)]}]},
                {"name": "after", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}]):
            conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES (%s, %s, %s)",
                         (spec["name"], i, json.dumps(spec)))
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=0))
    cp.wait_nodes("node-a")
    cp.wait_replicas("after", timeout_s=60)
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "after", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert all(rep["model"] != "huge" for rep in cp.replicas())
    # A model added later is placed by a later pass (every pass had failed after the one that met `huge`).
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES (%s, %s, %s)",
                     ("later", 2, json.dumps({"name": "later", "scaling": {"min": 1, "max": 1},
                                              "profiles": [{"engine": "sim"}]})))
    cp.wait_replicas("later", timeout_s=60)
    assert any("stored catalog model 'huge' cannot be read and is skipped" in p.log() for p in cp.procs)


def test_a_stored_model_this_version_cannot_read_keeps_its_running_engine(control_plane, database_url, tmp_path):
    """An upgrade whose rules are stricter (here: an argument longer than a value may be) makes a stored model
    unreadable. Its replicas had been stopped as "its model left the catalog": a deploy tore down a healthy
    engine. Now the replica and its engine (same pid) keep running; `ctl models` and `ctl catalog` name
    the model and why; a catalog that writes it again is a change, not an addition, and keeps the replica."""
    keep = {"name": "keep", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=0))
    cp.wait_nodes("node-a")
    assert cp.apply({"models": [keep]}).status_code == 200
    [rep] = cp.wait_replicas("keep", timeout_s=60)
    pid = cp.shard_pid("node-a", f"{rep['id']}-r0")
    # What a stricter version finds stored (written as an older one took it): unreadable now.
    bad = {**keep, "profiles": [{"engine": "sim", "args": ["--note", "x" * 9000]}]}
    third = {"name": "third", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE catalog_models SET spec = %s WHERE name = 'keep'", (json.dumps(bad),))
        conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES ('third', 9, %s)", (json.dumps(third),))
    cp.wait_replicas("third", timeout_s=60)  # placed by a pass whose snapshot could not read `keep`
    time.sleep(1.0)  # and a few passes more
    [still] = [r for r in cp.replicas(all=False) if r["model"] == "keep"]
    assert still["id"] == rep["id"] and still["status"] == "ready", cp.replicas()
    assert cp.shard_pid("node-a", f"{rep['id']}-r0") == pid
    os.kill(pid, 0)  # the engine runs
    out = cp.ctl("models")
    assert out.returncode == 0 and "keep" in out.stdout and "unreadable" in out.stdout, out.stdout
    [view] = [m for m in httpx.get(cp.admin + "/admin/v1/models", headers=cp.admin_headers).json() if m["name"] == "keep"]
    assert view["status"] == "unreadable" and "8192" in view["reason"], view
    out = cp.ctl("catalog")
    assert out.returncode == 0 and "# NOT IN THIS FILE: keep:" in out.stdout, out.stdout
    # Writing it again is a change of `keep`, and its replica is the one that serves it.
    dry = httpx.post(cp.admin + "/admin/v1/catalog", json={"catalog": {"models": [keep]}, "dry_run": True}, headers=cp.admin_headers).json()
    assert "keep" in dry["changed"] and "keep" not in dry["added"] and dry["removed"] == ["third"], dry
    assert cp.apply({"models": [keep, third]}).status_code == 200
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "keep", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [x["id"] for x in cp.replicas(all=False) if x["model"] == "keep"] == [rep["id"]]
    assert cp.shard_pid("node-a", f"{rep['id']}-r0") == pid


def test_a_node_whose_stored_inventory_this_version_refuses_does_not_wedge_the_reconciler(control_plane, database_url):
    """A node registered by an older llmgw with two GPUs of one index (refused since): reading the nodes
    raised in every pass, so nothing was placed or stopped anywhere. Now that node reads as empty, with a
    note, and the rest of the fleet is placed and served."""
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=0))
    cp.wait_nodes("node-a")
    gpu = {"index": 0, "name": "H100", "memory_mb": 81920}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO nodes (id, boot_id, inventory, last_heartbeat) VALUES ('old-node', 'b1', %s, now())",
                     (json.dumps({"gpus": [gpu, gpu], "cpus": 8, "memory_mb": 65536, "engines": ["sim"]}),))
    assert cp.apply({"models": [{"name": "after", "scaling": {"min": 1, "max": 1},
                                 "profiles": [{"engine": "sim"}]}]}).status_code == 200

    def placed():  # read from the database: the admin API's replica list had failed the same way
        with psycopg.connect(database_url, autocommit=True) as conn:
            return conn.execute("SELECT s.node_id FROM replicas r JOIN shards s ON s.replica_id = r.id "
                                "WHERE r.model = 'after' AND r.status = 'ready'").fetchall()
    assert wait_until(placed, timeout_s=60, what="`after` placed and ready", why=cp.logs) == [("node-a",)]
    out = cp.ctl("nodes")
    assert out.returncode == 0 and "old-node" in out.stdout, out.stdout + out.stderr
    [old] = [n for n in httpx.get(cp.admin + "/admin/v1/nodes", headers=cp.admin_headers).json() if n["id"] == "old-node"]
    assert old["inventory"]["gpus"] == [] and "cannot be read" in " ".join(old["inventory"]["notes"]), old
