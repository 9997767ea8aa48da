"""A start's fetch is retried while it makes progress, not for a number of attempts (issue 38): a transient
failure is retryable until the download has made no progress for `fetch_retry_s` (carried across attempts
in the heartbeat's `moved_at`), then it fails for good; a permanent one fails for good at once. Node
activities as Temporal runs them (`ActivityEnvironment`); the whole path, six agent restarts during one
download, is tests/faults/test_start_faults.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from llmgw.config import Settings
from llmgw.node.activities import NodeActivities
from llmgw.node.agent import Agent
from llmgw.schemas.payloads import FetchWeightsInput
from llmgw.weights.download import FetchError


def activities(tmp_path, error: FetchError) -> NodeActivities:
    a = Agent(Settings(state_dir=tmp_path, node_id="n1", mirror_url="http://127.0.0.1:9", fetch_retry_s=60))

    async def fetch(source, progress, peers=None):
        progress(10, 100)  # (the same bytes as before: no progress)
        raise error
    a.fetcher.fetch = fetch  # type: ignore[method-assign]
    return NodeActivities(a)


def attempt(details: list) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=7, heartbeat_details=details)
    beats: list = []
    env.on_heartbeat = lambda *d: beats.append(d)
    env.beats = beats  # type: ignore[attr-defined]
    return env


INPUT = FetchWeightsInput(replica_id="r1", source="https://example.com/w.gguf", generation=0)


async def test_a_transient_failure_with_recent_progress_is_retried_whatever_the_attempt(tmp_path):
    acts = activities(tmp_path, FetchError("connection reset"))
    env = attempt([{"bytes": 10, "moved_at": time.time() - 30}])  # progress 30 s ago, the 7th attempt
    with pytest.raises(ApplicationError) as e:
        await env.run(acts.fetch_weights, INPUT)
    assert not e.value.non_retryable
    assert env.beats[-1][0]["moved_at"] < time.time() - 29  # carried on to the next attempt, not reset


async def test_a_transient_failure_without_progress_for_fetch_retry_s_fails_for_good(tmp_path):
    acts = activities(tmp_path, FetchError("connection reset"))
    env = attempt([{"bytes": 10, "moved_at": time.time() - 90}])
    with pytest.raises(ApplicationError, match="no progress for 9[0-9]s") as e:
        await env.run(acts.fetch_weights, INPUT)
    assert e.value.non_retryable


async def test_progress_in_this_attempt_renews_the_bound_and_a_first_attempt_starts_it(tmp_path):
    acts = activities(tmp_path, FetchError("connection reset"))
    env = attempt([{"bytes": 5, "moved_at": time.time() - 90}])  # 5 bytes then; this attempt reached 10
    with pytest.raises(ApplicationError) as e:
        await env.run(acts.fetch_weights, INPUT)
    assert not e.value.non_retryable
    with pytest.raises(ApplicationError) as e:
        await attempt([]).run(acts.fetch_weights, INPUT)
    assert not e.value.non_retryable


async def test_a_permanent_failure_is_not_retried(tmp_path):
    acts = activities(tmp_path, FetchError("HTTP 404 (no such file)", retryable=False))
    with pytest.raises(ApplicationError) as e:
        await attempt([]).run(acts.fetch_weights, INPUT)
    assert e.value.non_retryable
