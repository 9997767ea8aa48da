"""What a catalog may hold: sizes of engine flags and profiles, alias names, names that fold to another,
numbers with bounds. Each is refused at apply naming the field and what to write; what an older llmgw
stored (or SQL wrote) is read around, never a wedged reconciler or a lost model.

The rules through the real admin API are at the end; a stored profile too big to travel, through a real
control plane and node, is in test_fleet_catalog.py."""

from __future__ import annotations

import json

import psycopg
import pytest

from llmgw.catalog import CatalogError, read_catalog
from llmgw.config import Settings
from llmgw.db import catalog_repo
from llmgw.db.engine import async_engine
from llmgw.schemas.catalog import MAX_ARG_CHARS, MAX_PROFILE_BYTES
from llmgw.schemas.payloads import DecideResult, PassAction

TEMPORAL_PAYLOAD_LIMIT = 2 * 1024 * 1024


def refused(doc) -> list[str]:
    with pytest.raises(CatalogError) as exc:
        read_catalog(doc)
    return exc.value.problems


def model(name: str = "m", **kw) -> dict:
    return {"name": name, "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}], **kw}


def vllm(a: int, b: int) -> dict:
    """A vLLM profile whose two JSON flags hold about `a` and `b` characters (allowed flags, real values)."""
    return {"engine": "vllm", "source": "Qwen/Qwen2.5-0.5B-Instruct", "gpu_memory_gb": 10,
            "args": ["--override-generation-config", json.dumps({"a": "a" * a}),
                     "--mm-processor-kwargs", json.dumps({"b": "b" * b})]}


def test_an_engine_flag_or_a_profile_too_big_to_travel_is_refused_naming_it():
    [p] = refused({"models": [model(profiles=[{"engine": "sim", "args": ["--x", "a" * (MAX_ARG_CHARS + 1)]}])]})
    assert p.startswith("models[0] (m).profiles[0] (default).args: args[1] ('aaaa"), p
    assert f"holds {MAX_ARG_CHARS + 1} characters, more than {MAX_ARG_CHARS}; put a long value in a file" in p
    [p] = refused({"models": [model(profiles=[{"engine": "sim", "env": {"X": "v" * (MAX_ARG_CHARS + 1)}}])]})
    assert p.startswith("models[0] (m).profiles[0] (default).env: env 'X'") and "in a file on the node" in p, p
    many = [f"--flag-{i}=" + "v" * 100 for i in range(200)]  # each short, together past 16 KiB
    [p] = refused({"models": [model(profiles=[{"engine": "sim", "args": many}])]})
    assert "profile 'default' is" in p and f"more than {MAX_PROFILE_BYTES}" in p, p
    [p] = refused({"models": [model(profiles=[{"engine": "sim", "args": ["--x"] * 257}])]})
    assert p.startswith("models[0] (m).profiles[0] (default).args: List should have at most 256 items"), p
    read_catalog({"models": [model(profiles=[vllm(8000, 7000)])]})  # long real values pass


def test_a_pass_with_every_placement_carrying_the_biggest_profile_fits_a_temporal_payload():
    """The reason for the profile bound: a pass returns up to `reconcile_max_placements` places, each with
    its profile, in one activity result (a 3 MiB flag had made every pass fail to complete)."""
    profile = read_catalog({"models": [model(profiles=[vllm(8000, 7800)])]}).catalog.models[0].profiles[0]
    assert len(profile.model_dump_json()) > MAX_PROFILE_BYTES * 0.97
    n = Settings().reconcile_max_placements
    result = DecideResult(actions=[PassAction(kind="place", model="m" * 128, line="place " * 40, replica_id="r" * 36,
                                              profile="default", profile_spec=profile) for _ in range(n)],
                          interval_s=1, ready_timeout_s=1, drain_timeout_s=1)
    assert len(result.model_dump_json()) < TEMPORAL_PAYLOAD_LIMIT * 0.75


@pytest.mark.parametrize("alias", ["", " ", "a\nb", "x/../y", "x//y", "ｓｍｏｌ", "-lead", "a b", "\u202esim", "x" * 129])
def test_an_alias_is_held_to_the_name_rule(alias):
    [p] = refused({"models": [model(aliases=["ok-alias", alias])]})
    assert p.startswith("models[0] (m).aliases: aliases[1] ") and "is not allowed" in p, p


def test_names_that_differ_only_in_case_or_dash_are_refused_naming_both():
    problems = refused({"models": [model("Llama-3"), model("llama_3"), model("qwen", aliases=["LLAMA-3"])]})
    assert problems == [
        "models[1] (llama_3): name 'llama_3' differs from 'Llama-3' (model 'Llama-3') only in case or '_'/'-'; names "
        "must differ in more than that: rename one",
        "models[2] (qwen): name 'LLAMA-3' differs from 'Llama-3' (model 'Llama-3') only in case or '_'/'-'; names "
        "must differ in more than that: rename one"]
    # A model's own alias in another case routes to the same model: allowed.
    read_catalog({"models": [model("Llama-3", aliases=["llama_3", "llama3"])]})


@pytest.mark.parametrize("field, value, where", [
    ("priority", 10**20, "models[0] (m).priority: Input should be less than or equal to 1000000"),
    ("scaling", {"min": 0, "max": 10**9}, "models[0] (m).scaling.max: Input should be less than or equal to 4096"),
    ("scaling", {"min": 0, "max": 1, "idle_timeout": "99999h"}, "models[0] (m).scaling.idle_timeout: Input should be "
                                                                  "less than or equal to 31622400"),
    ("limits", {"max_concurrency": 10**12}, "models[0] (m).limits.max_concurrency: Input should be less than or "
                                             "equal to 1000000"),
    ("fallbacks", [f"f{i}" for i in range(17)], "models[0] (m).fallbacks: List should have at most 16 items"),
])
def test_a_number_or_a_count_past_its_bound_is_refused_naming_the_field(field, value, where):
    problems = refused({"models": [model(**{field: value})]})
    assert any(p.startswith(where) for p in problems), problems


@pytest.mark.parametrize("scaling, where", [
    ({"min": 0, "max": 1, "sleep_after": -5}, "scaling.sleep_after: Input should be greater than 0"),
    ({"min": 0, "max": 1, "sleep_after": 0}, "scaling.sleep_after: Input should be greater than 0"),
    ({"min": 0, "max": 1, "sleep_after": "99999h"}, "scaling.sleep_after: Input should be less than or equal to 31622400"),
    ({"min": 0, "max": 1, "sleep_after": "soon"}, "scaling.sleep_after: 'soon' is not a duration"),
    ({"min": 0, "max": 1, "sleep_after": True}, "scaling: `sleep_after` takes a number, not true"),
    ({"min": 0, "max": 1, "sleep_after": [1]}, "scaling.sleep_after: Input should be a valid number"),
    ({"min": 0, "max": 1, "sleep_after": float("inf")}, "scaling.sleep_after: Input should be a finite number"),
    ({"min": 0, "max": 1, "sleep_after": "10m", "idle_timeout": "5m"},
     "scaling: sleep_after (600s) must be shorter than idle_timeout (300s)"),
    ({"min": 0, "max": 1, "sleep_after": 600}, "scaling: sleep_after (600s) must be shorter than idle_timeout (600s)"),
    ({"min": 1, "max": 2, "sleep_after": 60}, "scaling: sleep_after applies to on-demand models (min 0)"),
    ({"min": 0, "max": 1, "sleep_afterr": 60}, "scaling.sleep_afterr: unknown field; did you mean 'sleep_after'?"),
])
def test_sleep_after_past_its_bounds_is_refused_naming_it(scaling, where):
    problems = refused({"models": [model(scaling=scaling)]})
    assert any(p.startswith(f"models[0] (m).{where}") for p in problems), problems


def test_sleep_after_is_read_as_a_duration_and_left_out_when_unset():
    m = read_catalog({"models": [model(scaling={"min": 0, "max": 1, "sleep_after": "90s", "idle_timeout": "10m"})]})
    assert m.catalog.models[0].scaling.sleep_after == 90.0
    plain = read_catalog({"models": [model()]}).catalog.models[0]
    assert "sleep_after" not in plain.model_dump_json()  # a stored model without it reads the same to older versions


@pytest.mark.integration
async def test_a_stored_model_with_a_bad_alias_keeps_serving_under_its_name(database_url):
    """An older llmgw took any alias: the model is read without it (logged), not skipped whole."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES (%s, %s, %s)",
                     ("old", 0, json.dumps({**model("old"), "aliases": ["", "good", "x/../y"]})))
    engine = async_engine(database_url)
    try:
        async with engine.connect() as conn:
            catalog = await catalog_repo.get_catalog(conn)
    finally:
        await engine.dispose()
    assert [(m.name, m.aliases) for m in catalog.models] == [("old", ["good"])]
