"""The pollers witness in rotation (issue 42): each pass reads a bounded slice of the nodes, those read
longest ago first, within a time budget (control/liveness.py), and a node's poller silence counts only up to
its last read (placement/liveness.py): a live node is never judged silent for not having been read, and a
dead one shows silent at most one rotation late. The same witness through real processes:
tests/faults/test_observer_faults.py and tests/test_fleet_lost_node.py."""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta
from types import SimpleNamespace

from llmgw.control.liveness import poll_ages, rotation
from llmgw.db import fleet_repo
from llmgw.db.engine import async_engine
from llmgw.placement.liveness import fleet_liveness, witness_status
from llmgw.schemas.inventory import Inventory
from llmgw.schemas.payloads import LivenessFacts
from llmgw.workflows.queues import node_queue
from tests.fleet import NOW, node, snapshot

UNREACHABLE, LOST, GRACE = 15.0, 300.0, 60.0


def row(node_id: str, read_s_ago: float | None) -> fleet_repo.NodeRow:
    return fleet_repo.NodeRow(node_id, None, Inventory(), NOW, 0.0,
                              poll_read_at=None if read_s_ago is None else NOW - timedelta(seconds=read_s_ago))


def test_a_pass_reads_the_never_read_first_then_the_longest_unread_and_no_more_than_its_share():
    nodes = [row("a", 5), row("b", 50), row("c", None), row("d", 20), row("e", None)]
    assert rotation(nodes, 3) == ["c", "e", "b"]
    assert rotation(nodes, 100) == ["c", "e", "b", "d", "a"]


def test_every_node_is_read_within_ceil_n_over_the_share_passes():
    """The freshness bound: N nodes, K a pass, each read at least every ceil(N/K) passes, in steady state
    and from a fleet never read."""
    n, k = 103, 10
    reads: dict[str, float | None] = {f"n{i:03}": None for i in range(n)}
    last: dict[str, int] = {}
    gaps = []
    for p in range(60):
        for i in rotation([row(x, None if t is None else 1000 - t) for x, t in reads.items()], k):
            if i in last:
                gaps.append(p - last[i])
            last[i], reads[i] = p, float(p)
    assert len(last) == n and max(gaps) == math.ceil(n / k)


def test_poller_silence_counts_only_up_to_the_last_read():
    def live(poll: float | None, read: float | None, pollers: float = 10_000):
        return witness_status(1000, poll, 10_000, pollers, UNREACHABLE, LOST, GRACE, read)
    # Polling when last read 500 s ago (seen 30 s before that read): not silent, however long unread.
    assert live(poll=530, read=500).status == "ready" and live(poll=530, read=500).poller_silent_s == 0
    # Dead: its last read, 10 s ago, found its last poll 400 s before it; silent 400 - grace by then.
    dead = live(poll=410, read=10)
    assert dead.status == "lost" and dead.poller_silent_s == 400 - GRACE
    # Unreachable by the read, not yet lost: lost shows once a later read sees more silence.
    assert live(poll=GRACE + UNREACHABLE + 100, read=100).status == "unreachable"
    # A read this pass (or a snapshot from before the rotation, None): as before.
    assert live(poll=1000, read=None).status == live(poll=1000, read=0).status == "lost"
    # The pollers' run of sight still caps it (the control worker was down until 20 s ago).
    assert live(poll=1000, read=5, pollers=20).poller_silent_s == 20


def test_a_node_unread_for_long_is_not_declared_lost_and_one_read_dead_is():
    unread = node("unread", age_s=1000).model_copy(update={
        "polled_at": NOW - timedelta(seconds=600), "poll_read_at": NOW - timedelta(seconds=590)})
    dead = node("dead", age_s=1000).model_copy(update={
        "polled_at": NOW - timedelta(seconds=600), "poll_read_at": NOW - timedelta(seconds=1)})
    fresh = [node(f"f{i}").model_copy(update={"polled_at": NOW, "poll_read_at": NOW}) for i in range(4)]
    snap = snapshot([], [unread, dead, *fresh])
    snap.liveness = LivenessFacts(observer_since=NOW - timedelta(days=1), pollers_since=NOW - timedelta(days=1),
                                  poller_grace_s=GRACE)
    live = fleet_liveness(snap)
    assert live.status("unread") == "ready" and live.status("dead") == "lost"


class FakeService:
    """`describe_task_queue` as Temporal answers it: after `slow_s` for the queues in `slow` (else `fast_s`), an error for
    those in `broken`, else one poller last seen 3 s ago, or none for those in `idle`."""

    def __init__(self, slow: set[str] = frozenset(), broken: set[str] = frozenset(), idle: set[str] = frozenset(),
                 slow_s: float = 5.0, fast_s: float = 0.001):
        self.slow, self.broken, self.idle, self.slow_s, self.fast_s = slow, broken, idle, slow_s, fast_s
        self.asked: list[str] = []

    async def describe_task_queue(self, req):
        import time as _time
        from temporalio.api.taskqueue.v1 import PollerInfo
        from temporalio.api.workflowservice.v1 import DescribeTaskQueueResponse
        name = req.task_queue.name
        self.asked.append(name)
        if name in self.broken:
            raise RuntimeError("unavailable")
        await asyncio.sleep(self.slow_s if name in self.slow else self.fast_s)
        resp = DescribeTaskQueueResponse()
        if name not in self.idle:
            p = PollerInfo()
            p.last_access_time.FromNanoseconds(int((_time.time() - 3) * 1e9))
            resp.pollers.append(p)
        return resp


def client(service: FakeService):
    return SimpleNamespace(namespace="ns", workflow_service=service)


async def test_a_pass_asks_in_order_until_its_budget_and_keeps_every_answer_it_asked_for():
    ids = [f"n{i:03}" for i in range(300)]
    svc = FakeService(slow={node_queue("n000")}, idle={node_queue("n001")}, slow_s=0.3, fast_s=0.02)
    ages, read, error = await poll_ages(client(svc), ids, budget_s=0.1)
    # n00 was asked first and answered late, after the budget: kept (a slow node slows the pass, and is
    # not passed over); the 16 askers asked no more once the budget was spent: the rest wait for next pass.
    assert error is None and "n000" in read and "n001" in read and "n001" not in ages and 2 < ages["n000"] < 5
    assert 16 <= len(read) < 300 and svc.asked == [node_queue(i) for i in ids[:len(svc.asked)]]
    assert set(read) == {i for i in ids if node_queue(i) in svc.asked}


async def test_a_slow_temporal_slows_the_pass_but_the_witness_still_sees():
    svc = FakeService(slow={node_queue("a"), node_queue("b")}, slow_s=0.3)
    ages, read, error = await poll_ages(client(svc), ["a", "b"], budget_s=0.05, limit_s=2)
    assert error is None and sorted(read) == ["a", "b"] and set(ages) == {"a", "b"}


async def test_an_rpc_error_or_no_answer_in_time_makes_the_witness_unreadable_this_pass():
    _, read, error = await poll_ages(client(FakeService(broken={node_queue("b")})), ["a", "b"], budget_s=1)
    assert read == [] and "unavailable" in error
    _, read, error = await poll_ages(client(FakeService(slow={node_queue("a")})), ["a"], budget_s=0.1, limit_s=0.2)
    assert read == [] and "no answer from Temporal within 0.2s" in error
    assert await poll_ages(client(FakeService()), [], budget_s=1) == ({}, [], None)


async def test_the_read_time_is_kept_per_node_and_reaches_the_gateway_and_the_next_pass(database_url):
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            for n in ("a", "b", "c"):
                await fleet_repo.upsert_node(conn, n, "boot", Inventory())
            now = await fleet_repo.db_now(conn)
            # a was read and seen polling, b read and not polling, c not read this pass.
            await fleet_repo.set_polled(conn, {"a": now - timedelta(seconds=3)}, ["a", "b"], now)
            rows = {n.id: n for n in await fleet_repo.list_nodes(conn)}
            assert rows["a"].poll_read_at == rows["b"].poll_read_at == now and rows["c"].poll_read_at is None
            assert rows["b"].polled_at is None
            assert rotation(list(rows.values()), 1) == ["c"]
    finally:
        await engine.dispose()


def test_the_rotation_settings_refuse_what_cannot_work():
    import pytest
    from pydantic import ValidationError

    from llmgw.config import Settings

    for field, bad in (("poller_reads_per_pass", 0), ("poller_reads_per_pass", -5), ("poller_reads_per_pass", 10**9),
                       ("poller_reads_per_pass", "many"), ("poller_read_budget_s", 0), ("poller_read_budget_s", -1),
                       ("poller_read_budget_s", 3600), ("poller_read_budget_s", "soon")):
        with pytest.raises(ValidationError, match=field):
            Settings(**{field: bad})
    s = Settings()
    assert (s.poller_reads_per_pass, s.poller_read_budget_s) == (1024, 1.0)
