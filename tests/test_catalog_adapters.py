"""LoRA adapters in the catalog (issue 40): their names share the model-name space, a base whose profiles
cannot load adapters at run time is refused saying what to write, ranks are checked against the profile, and
abusive input is refused naming the field."""

from __future__ import annotations

import pytest

from llmgw.catalog import CatalogError, read_catalog
from llmgw.schemas.catalog import MAX_ADAPTERS, MAX_LAUNCH_BYTES


def base(**over) -> dict:
    return {"name": "base", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim", "max_loras": 2}],
            "adapters": [{"name": "sql", "source": "/adapters/sql"},
                         {"name": "chat-x", "source": "org/chat-x", "version": "3", "rank": 8, "tenants": ["acme"]}],
            **over}


def refused(*models: dict) -> list[str]:
    with pytest.raises(CatalogError) as exc:
        read_catalog({"models": list(models)})
    return exc.value.problems


def test_adapters_are_read_under_their_base_and_unset_fields_stay_out_of_the_json():
    m = read_catalog({"models": [base()]}).catalog.models[0]
    assert [a.name for a in m.adapters] == ["sql", "chat-x"]
    assert m.adapter("chat-x").allows("acme") and not m.adapter("chat-x").allows("other")
    assert not m.adapter("chat-x").allows(None)  # a key of no tenant is not in an allowlist
    assert m.adapter("sql").allows(None) and m.adapter("sql").allows("anyone")
    dumped = m.model_dump(mode="json")
    assert dumped["adapters"][0] == {"name": "sql", "source": "/adapters/sql"}
    assert dumped["profiles"][0]["max_loras"] == 2 and "max_lora_rank" not in dumped["profiles"][0]
    plain = read_catalog({"models": [{"name": "p", "profiles": [{"engine": "sim"}]}]}).catalog.models[0]
    assert "adapters" not in plain.model_dump(mode="json")  # a catalog without adapters reads as before
    assert "max_loras" not in plain.profiles[0].model_dump(mode="json")  # (and keeps its spec hash)


def test_an_adapter_name_clashing_with_a_model_an_alias_or_another_adapter_is_refused():
    other = {"name": "other", "aliases": ["o2"], "profiles": [{"engine": "sim"}]}
    assert "name 'base' is already used by model 'base'" in refused(
        base(adapters=[{"name": "base", "source": "x"}]))[0]
    assert "name 'o2' is already used by model 'other'" in refused(
        other, base(adapters=[{"name": "o2", "source": "x"}]))[0]
    problems = refused(base(), {**other, "aliases": ["sql"]})
    assert "name 'sql' is already used by adapter of model 'base'" in problems[0]
    problems = refused(base(adapters=[{"name": "sql", "source": "x"}, {"name": "sql", "source": "y"}]))
    assert "already used" in problems[0]


def test_adapter_names_that_normalise_to_another_are_refused():
    for first, second in (("sql", "SQL"), ("chat-x", "chat_X"), ("base", "BASE")):
        problems = refused(base(adapters=[{"name": first, "source": "x"}, {"name": second, "source": "y"}]))
        assert any(f"name {second!r} differs from" in p and "only in case" in p for p in problems), problems
    for bad in ("a/../b", "x//y", "ｓｑｌ", "", "-lead", "a" * 129):
        problems = refused(base(adapters=[{"name": bad, "source": "x"}]))
        assert "adapters[0]" in problems[0] and "name" in problems[0], problems


def test_a_base_whose_profiles_cannot_load_adapters_is_refused_saying_what_to_write():
    (p,) = refused(base(profiles=[{"engine": "sglang", "source": "org/m"}]))
    assert "profiles[0] (default)" in p and "sglang's adapter calls are not supported" in p and "vllm, sim" in p
    (p,) = refused(base(profiles=[{"engine": "vllm", "source": "org/m"}]))
    assert "write `max_loras: N`" in p
    (p,) = refused(base(profiles=[], endpoints=["http://10.0.0.1:8000"]))
    assert "adapters" in p and "endpoints" in p
    (p,) = refused({"name": "l", "profiles": [{"engine": "llamacpp", "source": "/m.gguf", "max_loras": 2}]})
    assert "max_loras: engine llamacpp does not load adapters" in p


def test_a_llamacpp_base_takes_gguf_file_adapters_of_any_rank_and_refuses_the_rest():
    gguf = [{"name": "sql", "source": "mirror:sql.gguf", "rank": 512}, {"name": "legal", "source": "/a/legal.gguf"}]
    m = read_catalog({"models": [base(profiles=[{"engine": "llamacpp", "source": "/m.gguf"}], adapters=gguf)]})
    launched = m.catalog.models[0].launch_profile(m.catalog.models[0].profiles[0])
    assert [(a.name, a.source) for a in launched.adapters] == [("sql", "mirror:sql.gguf"), ("legal", "/a/legal.gguf")]
    problems = refused(base(profiles=[{"engine": "llamacpp", "source": "/m.gguf"}]))  # a hub id; a version below
    assert problems == ["models[0] (base).adapters[1] (chat-x).source: 'org/chat-x' is not a file llama.cpp can "
                        "load; write mirror:NAME.gguf, an http(s) URL of the GGUF, or its path on the node"]
    (p,) = refused(base(profiles=[{"engine": "llamacpp", "source": "/m.gguf"}],
                        adapters=[{"name": "v", "source": "mirror:v/"}]))
    assert "adapters[0] (v).source" in p
    (p,) = refused(base(profiles=[{"engine": "llamacpp", "source": "/m.gguf", "max_loras": 2}], adapters=gguf))
    assert "reads no `max_loras`; remove it" in p


def test_only_fetched_adapters_travel_with_a_vllm_launch_and_a_profile_may_not_name_them():
    m = read_catalog({"models": [base(adapters=[{"name": "a", "source": "mirror:a/"},
                                                {"name": "b", "source": "/srv/b"}])]}).catalog.models[0]
    launched = m.launch_profile(m.profiles[0])
    assert [a.name for a in launched.adapters] == ["a"] and launched.spec_hash() != m.profiles[0].spec_hash()
    plain = read_catalog({"models": [base(adapters=[{"name": "b", "source": "/srv/b"}])]}).catalog.models[0]
    assert plain.launch_profile(plain.profiles[0]) is plain.profiles[0]  # nothing to fetch: the same hash
    (p,) = refused(base(profiles=[{"engine": "sim", "max_loras": 2, "adapters": [{"name": "a", "source": "/x"}]}]))
    assert "`adapters` is written under the model, not a profile" in p


def test_an_adapter_rank_above_the_profile_max_lora_rank_is_refused():
    (p,) = refused(base(adapters=[{"name": "big", "source": "x", "rank": 64}]))
    assert "adapters[0] (big).rank: 64 exceeds profile 'default''s max_lora_rank (16, the default)" in p
    assert "max_lora_rank: 64" in p
    ok = base(adapters=[{"name": "big", "source": "x", "rank": 64}],
              profiles=[{"engine": "vllm", "source": "org/m", "max_loras": 4, "max_lora_rank": 64}])
    assert read_catalog({"models": [ok]}).catalog.models[0].adapters[0].rank == 64


def test_abusive_adapter_input_is_refused_naming_the_field():
    many = [{"name": f"a{i}", "source": "x"} for i in range(1000)]
    (p,) = refused(base(adapters=many))
    assert p.startswith("models[0] (base).adapters") and str(MAX_ADAPTERS) in p
    cases = {
        "rank": ({"name": "a", "source": "x", "rank": -1}, "rank"),
        "rank_bool": ({"name": "a", "source": "x", "rank": True}, "takes a number"),
        "rank_huge": ({"name": "a", "source": "x", "rank": 10**9}, "rank"),
        "source_empty": ({"name": "a", "source": ""}, "source"),
        "source_newline": ({"name": "a", "source": "x\n\x1b[2J"}, "control characters"),
        "source_missing": ({"name": "a"}, "source"),
        "unknown": ({"name": "a", "source": "x", "lora_path": "y"}, "unknown field"),
        "tenants_type": ({"name": "a", "source": "x", "tenants": "acme"}, "tenants"),
        "tenant_name": ({"name": "a", "source": "x", "tenants": ["Acme Corp"]}, "tenant names"),
        "name_type": ({"name": 7, "source": "x"}, "name"),
        "not_mapping": ("sql", "adapters[0]"),
    }
    for what, (adapter, says) in cases.items():
        problems = refused(base(adapters=[adapter]))
        assert any("adapters[0]" in p and says in p for p in problems), (what, problems)
    for profile, field in (({"max_loras": 0}, "max_loras"), ({"max_loras": 100000}, "max_loras"),
                           ({"max_loras": 2, "max_lora_rank": -3}, "max_lora_rank")):
        problems = refused(base(profiles=[{"engine": "sim", **profile}]))
        assert any(field in p for p in problems), problems


def test_a_fallback_or_guard_naming_an_adapter_is_refused():
    judge = {"name": "judge", "role": "guard", "profiles": [{"engine": "sim"}]}
    p = refused(base(), {"name": "m", "fallbacks": ["sql"], "profiles": [{"engine": "sim"}]})
    assert any("fallbacks: 'sql' is an adapter" in x for x in p), p
    p = refused(base(), judge, {"name": "m", "guard": {"model": "sql"}, "profiles": [{"engine": "sim"}]})
    assert any("guard.model: 'sql' is an adapter" in x for x in p), p


def test_the_apply_diff_names_each_adapter_changed_by_its_name():
    from llmgw.db.catalog_repo import field_changes

    old = read_catalog({"models": [base()]}).catalog.models[0]
    new = read_catalog({"models": [base(adapters=[{"name": "sql", "source": "/adapters/sql", "version": "2"},
                                                  {"name": "law", "source": "/adapters/law"}])]}).catalog.models[0]
    lines = field_changes(old, new)
    assert "adapters[sql].version: (unset) -> 2" in lines
    assert "adapters[law].source: (unset) -> /adapters/law" in lines
    assert "adapters[chat-x].source: org/chat-x -> (unset)" in lines


def test_the_adapters_a_launch_carries_are_bounded_so_a_pass_stays_within_temporals_payload_limit():
    """A profile travels with its fetched adapters in every start (Temporal payloads, 2 MiB per pass): 256
    adapters with 4 KiB URLs would have made one profile a megabyte. Bounded per profile as launched, with
    the fix named; a realistic set of mirrored adapters fits."""
    long = [{"name": f"a{i}", "source": "https://host/" + "x" * 4000 + f"/{i}.safetensors"} for i in range(8)]
    (p,) = refused(base(adapters=long))
    assert f"more than {MAX_LAUNCH_BYTES}" in p and "`mirror:NAME`" in p and "profile 'default'" in p, p
    plain = [{"name": f"a{i}", "source": "/srv/" + "x" * 4000} for i in range(8)]  # node paths travel not
    assert len(read_catalog({"models": [base(adapters=plain)]}).catalog.models[0].adapters) == 8
    mirrored = [{"name": f"adapter-{i}", "source": f"mirror:adapter-{i}/", "version": "1"} for i in range(128)]
    m = read_catalog({"models": [base(adapters=mirrored)]}).catalog.models[0]
    assert len(m.launch_profile(m.profiles[0]).adapters) == 128

