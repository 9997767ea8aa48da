"""Control activities give the same answer when retried after their transaction committed (issue 9, item 4):
each is run as Temporal runs it (`ActivityEnvironment`), against a real Postgres, twice with the same
workflow run and activity id, as a retry after a lost completion would be. The retry through the real
worker, killed after the commit, is tests/faults/test_start_faults.py."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import select
from temporalio.testing import ActivityEnvironment

from llmgw.control.activities import ControlActivities
from llmgw.db import catalog_repo
from llmgw.db.engine import async_engine
from llmgw.db.tables import replicas
from llmgw.schemas.payloads import (
    MarkReplicaInput, RecordPlacementInput, RecordReplicaFailureInput, ResetModelFailuresInput, SettleReplicaInput,
    ShardPlacement,
)

pytestmark = pytest.mark.integration


def attempt(activity_id: str, n: int, run: str = "run-1") -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_run_id=run, activity_id=activity_id, attempt=n)
    return env


async def test_retried_state_changes_answer_the_same_and_act_once(database_url):
    engine = async_engine(database_url)
    acts = ControlActivities(engine, 15, 300)
    try:
        place = RecordPlacementInput(replica_id="r1", model="m", profile="default", shards=[ShardPlacement(node_id="n1")])
        for n in (1, 2):
            await attempt("1", n).run(acts.record_placement, place)

        ready = MarkReplicaInput(replica_id="r1", status="ready", endpoint="http://127.0.0.1:1")
        first = await attempt("2", 1).run(acts.mark_replica, ready)
        retried = await attempt("2", 2).run(acts.mark_replica, ready)
        assert first.applied and retried == first  # before: the retry answered "not applied"
        # Ready is where a start wants its replica, whoever marked it (its node pushes readiness first, issue
        # 13): a new call finds it so and says applied, changing nothing.
        assert (await attempt("3", 1).run(acts.mark_replica, ready)).applied

        draining = MarkReplicaInput(replica_id="r1", status="draining")
        a = await attempt("4", 1).run(acts.mark_replica, draining)
        b = await attempt("4", 2).run(acts.mark_replica, draining)
        assert a.applied and b == a
        # The same call as a new activity (another id) is a new question, and gets the honest answer.
        assert not (await attempt("4b", 1).run(acts.mark_replica, draining)).applied
        failed = MarkReplicaInput(replica_id="r1", status="failed", failure="engine died")
        f1 = await attempt("5", 1).run(acts.mark_replica, failed)
        assert (await attempt("5", 3).run(acts.mark_replica, failed)) == f1
        async with engine.connect() as conn:  # one bump per step towards stopping, not per attempt
            assert (await conn.execute(select(replicas.c.generation).where(replicas.c.id == "r1"))).scalar_one() == 3

        settle = SettleReplicaInput(replica_id="r1", reason="failed to start")
        s1 = await attempt("6", 1).run(acts.settle_replica, settle)
        s2 = await attempt("6", 2).run(acts.settle_replica, settle)
        assert s1.applied and s2 == s1  # so the failure is counted by this workflow, once

        for n in (1, 2, 3):
            await attempt("7", n).run(acts.record_replica_failure, RecordReplicaFailureInput(model="m"))
        async with engine.connect() as conn:
            [state] = [s for s in await catalog_repo.model_states(conn) if s.name == "m"]
        assert state.failures == 1
    finally:
        await engine.dispose()


async def test_settling_a_failed_replica_counts_its_failure_in_the_same_transaction_once(database_url):
    """SETTLE_COUNTS: the settle that settles a failed replica also sets the backoff, so no reconcile pass
    can see the replica settled with no backoff yet (a CI run saw a start placed 0.25 s after a failure,
    between the two activities). Retried after its commit, it counts nothing twice; a second settle (another
    workflow, too late) counts nothing."""
    engine = async_engine(database_url)
    acts = ControlActivities(engine, 15, 300)
    try:
        place = RecordPlacementInput(replica_id="rc", model="mc", profile="default", shards=[ShardPlacement(node_id="n1")])
        await attempt("1", 1, run="run-c").run(acts.record_placement, place)
        failed = MarkReplicaInput(replica_id="rc", status="failed", failure="engine died")
        await attempt("2", 1, run="run-c").run(acts.mark_replica, failed)
        settle = SettleReplicaInput(replica_id="rc", reason="failed to start", count_failure=True)
        for n in (1, 2):
            res = await attempt("3", n, run="run-c").run(acts.settle_replica, settle)
            assert res.applied and res.status == "failed"
        assert not (await attempt("3", 1, run="run-other").run(acts.settle_replica, settle)).applied
        async with engine.connect() as conn:
            [state] = [s for s in await catalog_repo.model_states(conn) if s.name == "mc"]
        assert state.failures == 1 and state.backoff_until is not None and state.failed_at is not None
    finally:
        await engine.dispose()


async def test_a_retried_reset_does_not_clear_a_failure_counted_after_it(database_url):
    """Replica A reached Ready and its start cleared the model's failures; the completion was lost. Before
    the retry, replica B of the same model failed and set a backoff. The retry must not wipe B's failure."""
    engine = async_engine(database_url)
    acts = ControlActivities(engine, 15, 300)
    try:
        reset, failure = ResetModelFailuresInput(model="mr"), RecordReplicaFailureInput(model="mr")
        await attempt("9", 1, run="run-a").run(acts.reset_model_failures, reset)
        await attempt("1", 1, run="run-b").run(acts.record_replica_failure, failure)  # B's failure, counted
        await attempt("9", 2, run="run-a").run(acts.reset_model_failures, reset)  # A's retry after its commit
        async with engine.connect() as conn:
            [state] = [s for s in await catalog_repo.model_states(conn) if s.name == "mr"]
        assert state.failures == 1 and state.backoff_until is not None
        await attempt("9", 1, run="run-c").run(acts.reset_model_failures, reset)  # another start: a new reset
        async with engine.connect() as conn:
            [state] = [s for s in await catalog_repo.model_states(conn) if s.name == "mr"]
        assert state.failures == 0 and state.backoff_until is None
    finally:
        await engine.dispose()


async def test_a_first_attempt_on_a_used_key_acts_once(database_url):
    """A first attempt does not look for a stored result (one query less on every pass and state change,
    issue 13). If its key was used after all (an operator's `temporal activity reset` restarts the count on
    the same key), its insert of the key conflicts, nothing it did commits, and its retry returns the first
    result: the failure is still counted once."""
    engine = async_engine(database_url)
    acts = ControlActivities(engine, 15, 300)
    try:
        failure = RecordReplicaFailureInput(model="m-reset")
        await attempt("r1", 1, run="run-reset").run(acts.record_replica_failure, failure)
        with pytest.raises(Exception, match="activity_results|duplicate key|UniqueViolation"):
            await attempt("r1", 1, run="run-reset").run(acts.record_replica_failure, failure)
        await attempt("r1", 2, run="run-reset").run(acts.record_replica_failure, failure)
        async with engine.connect() as conn:
            [state] = [s for s in await catalog_repo.model_states(conn) if s.name == "m-reset"]
        assert state.failures == 1
    finally:
        await engine.dispose()
