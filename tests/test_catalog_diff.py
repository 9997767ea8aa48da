"""The lines `llmgw ctl apply` shows for a changed model (db/catalog_repo.field_changes): profiles by name only,
a rename as one line, and a model with no `scaling` said to be off (issue 44)."""

from __future__ import annotations

from llmgw.catalog import read_catalog
from llmgw.db.catalog_repo import OFF, field_changes


def model(**over) -> object:
    m = {"name": "m", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]}
    m.update(over)
    return read_catalog({"models": [m]}).catalog.models[0]


def test_a_profile_renamed_with_nothing_else_changed_is_one_line_by_names():
    old = model(profiles=[{"engine": "sim", "args": ["--tokens-per-second", "5"]}])
    new = model(profiles=[{"name": "fast", "engine": "sim", "args": ["--tokens-per-second", "5"]}])
    assert field_changes(old, new) == ["profiles: default renamed to fast"]
    back = field_changes(new, model(profiles=[{"name": "quick", "engine": "sim", "args": ["--tokens-per-second", "5"]}]))
    assert back == ["profiles: fast renamed to quick"]


def test_a_renamed_profile_that_also_changed_is_told_field_by_field_under_its_names():
    old = model(profiles=[{"engine": "sim", "args": ["--tokens-per-second", "5"]}])
    new = model(profiles=[{"name": "fast", "engine": "sim", "args": ["--tokens-per-second", "50"]}])
    lines = field_changes(old, new)
    assert lines and all("[0]" not in line and "[1]" not in line for line in lines), lines
    assert "profiles[default].engine: sim -> (unset)" in lines and "profiles[fast].engine: (unset) -> sim" in lines


def test_scaling_removed_says_the_model_is_off():
    lines = field_changes(model(scaling={"min": 1, "max": 2}), model(scaling=None))
    assert lines == [f"scaling: min 1, max 2 -> {OFF}"], lines
    assert "off, it does not run; write `scaling: {max: 1}` to load it on demand" in OFF
