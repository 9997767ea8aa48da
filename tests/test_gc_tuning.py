"""The HTTP processes' collector tuning (http/gc_tuning.py): frozen start-up heap, a raised young threshold,
and 0 leaving Python's defaults. (That `llmgw server` tunes its gateway and node API processes is asserted
through the real processes in tests/test_fleet_sim.py.)"""

from __future__ import annotations

import gc

import pytest

from llmgw.config import Settings
from llmgw.http.gc_tuning import tune


@pytest.fixture
def restored():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_tune_freezes_the_heap_and_raises_the_young_threshold(restored):
    _, gen1, gen2 = gc.get_threshold()
    tune(50_000)
    assert gc.get_threshold() == (50_000, gen1, gen2) and gc.get_freeze_count() > 0


def test_zero_leaves_the_collector_as_python_has_it(restored):
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    tune(0)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


@pytest.mark.parametrize("value", ["-1", "10000001", "lots"])
def test_a_bad_threshold_is_refused_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv("LLMGW_GC_GEN0_THRESHOLD", value)
    with pytest.raises(ValueError, match="gc_gen0_threshold"):
        Settings()
