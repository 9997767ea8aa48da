"""Fair queues (issue 37): who of the requests waiting for a saturated model's slot gets the next one
(gateway/fairness.py through gateway/admission.py's gate), and the tenant settings that say it. The same
rule through real processes: tests/test_tenants.py `test_a_light_tenant_is_served_ahead_of_a_heavy_ones_backlog`."""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import ValidationError

from llmgw.catalog.context import OutputBound
from llmgw.db.keys_repo import ActiveKey
from llmgw.gateway.admission import Gate
from llmgw.gateway.fairness import BATCH, BATCH_EVERY, INTERACTIVE, SHARED_FLOW, Share, request_cost, share_of
from llmgw.gateway.quotas import Quotas
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Limits as ModelLimits
from llmgw.schemas.tenants import Limits
from llmgw.telemetry import GatewayMetrics


def gate(slots: int = 1, queue: int = 100, timeout_s: float = 60) -> Gate:
    return Gate("m", ModelLimits(max_concurrency=slots, max_queue=queue, queue_timeout_s=timeout_s))


class Waiting:
    """Requests queued at a full gate, each recording its name when it gets a slot."""

    def __init__(self, g: Gate):
        self.g = g
        self.served: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def add(self, name: str, share: Share) -> asyncio.Task:
        async def wait() -> None:
            await self.g.acquire(share)
            self.served.append(name)

        t = asyncio.create_task(wait())
        self.tasks.append(t)
        for _ in range(2):  # queued now, in this order (and a waiter it pushed out has ended)
            await asyncio.sleep(0)
        return t

    async def serve(self, n: int) -> list[str]:
        """Free `n` slots one after the other; the names served by them."""
        before = len(self.served)
        for _ in range(n):
            self.g.release()
            await asyncio.sleep(0)
        return self.served[before:]


async def test_a_light_flow_is_served_next_not_behind_a_heavy_flows_backlog():
    g = gate()
    g.try_acquire()
    w = Waiting(g)
    for i in range(10):
        await w.add(f"h{i}", Share(("tenant", "h"), cost=100))
    await w.serve(3)  # h0 h1 h2 go first: nobody else waited
    await w.add("l0", Share(("tenant", "l"), cost=100))
    assert await w.serve(2) == ["l0", "h3"]  # next, not behind the 7 still waiting
    assert g.queued == 6
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)


async def test_backlogged_flows_share_slots_by_weight_and_by_tokens():
    g = gate(queue=1000)
    g.try_acquire()
    w = Waiting(g)
    for i in range(200):  # weights 1 and 3, the same cost: 1 slot in 4 and 3 in 4
        await w.add("a", Share(("tenant", "a"), weight=1, cost=50))
        await w.add("b", Share(("tenant", "b"), weight=3, cost=50))
    got = await w.serve(200)
    assert abs(got.count("b") / got.count("a") - 3) < 0.2, (got.count("a"), got.count("b"))
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)
    g2 = gate(queue=1000)
    g2.try_acquire()
    w = Waiting(g2)
    for i in range(200):  # equal weights, requests of 400 and of 40 tokens: ten short ones for one long one
        await w.add("long", Share(("tenant", "a"), cost=400))
        await w.add("short", Share(("tenant", "b"), cost=40))
    got = await w.serve(110)
    assert 9 <= got.count("short") / got.count("long") <= 11, (got.count("long"), got.count("short"))
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)


async def test_interactive_is_served_first_and_batch_gets_one_slot_in_ten_while_both_wait():
    g = gate(queue=1000)
    g.try_acquire()
    w = Waiting(g)
    for i in range(5):
        await w.add("batch", Share(("tenant", "b"), band=BATCH))
    assert await w.serve(1) == ["batch"]  # nobody interactive waits: batch is served
    for i in range(50):
        await w.add("inter", Share(("tenant", "i"), band=INTERACTIVE))
    got = await w.serve(3 * BATCH_EVERY)
    assert got.count("batch") == 3 and got[:BATCH_EVERY - 1] == ["inter"] * (BATCH_EVERY - 1), got
    assert got[BATCH_EVERY - 1] == "batch"
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)
    assert g.queued == 0


async def test_a_full_queue_refuses_the_heaviest_flows_newest_not_a_light_newcomer():
    g = gate(queue=4)
    g.try_acquire()
    w = Waiting(g)
    heavy = [await w.add(f"h{i}", Share(("tenant", "h"))) for i in range(4)]
    with pytest.raises(APIError) as e:  # the heavy tenant's own newcomer: refused as before
        await g.acquire(Share(("tenant", "h")))
    assert e.value.status == 429
    await w.add("l0", Share(("tenant", "l")))  # a light one takes the place of h3 (the newest)
    await asyncio.sleep(0)
    assert heavy[3].done() and isinstance(heavy[3].exception(), APIError) and heavy[3].exception().status == 429
    assert g.queued == 4
    await w.add("l1", Share(("tenant", "l")))  # 2 and 2 now: h2 gives way only while h holds more
    assert heavy[2].done() and g.queued == 4
    with pytest.raises(APIError):  # l would hold 3 against h's 2: l's own newcomer is refused
        await g.acquire(Share(("tenant", "l")))
    await w.add("x", Share(("tenant", "x")))  # a third flow: h (the first of the heaviest) gives way again
    assert heavy[1].done() and not heavy[0].done()
    assert await w.serve(4) == ["h0", "l0", "x", "l1"]  # start tags 0, 0, 0, 1: arrival order breaks ties
    batch = gate(queue=1)
    batch.try_acquire()
    wb = Waiting(batch)
    b = await wb.add("b", Share(("tenant", "b"), band=BATCH))
    await wb.add("i", Share(("tenant", "b2"), band=INTERACTIVE))  # an interactive newcomer pushes batch out
    assert b.done() and b.exception().status == 429
    with pytest.raises(APIError):  # ... and never the other way round
        await batch.acquire(Share(("tenant", "b3"), band=BATCH))
    assert await wb.serve(1) == ["i"]


async def test_a_waiter_that_leaves_or_times_out_gives_its_place_and_its_tags_back():
    g = gate(timeout_s=0.05)
    g.try_acquire()
    w = Waiting(g)
    gone = await w.add("gone", Share(("tenant", "a"), cost=1000))
    stays = await w.add("b", Share(("tenant", "b")))
    gone.cancel()
    await asyncio.sleep(0)
    band = g.waiters.bands[INTERACTIVE]
    assert band.flows[("tenant", "a")].finish == 0.0  # the cancelled request charged its flow nothing
    assert await w.serve(1) == ["b"] and stays.done()
    late = await w.add("late", Share(("tenant", "c")))
    await asyncio.sleep(0.1)
    assert late.done() and late.exception().status == 503 and g.queued == 0
    g.release()
    assert g.active == 0


async def test_a_free_slot_is_taken_at_once_and_with_nobody_waiting_the_gate_keeps_no_memory():
    g = gate(slots=2)
    assert g.try_acquire() and g.try_acquire() and not g.try_acquire()
    w = Waiting(g)
    await w.add("x", Share(("tenant", "a"), cost=10))
    assert not g.try_acquire()  # someone waits: no overtaking through the fast path
    await w.serve(1)
    assert g.waiters.bands[INTERACTIVE].flows == {} and g.waiters.bands[INTERACTIVE].vtime == 0


def test_a_requests_share_comes_from_its_tenant_and_key_and_a_key_never_gets_more():
    q = Quotas(engine=None, metrics=GatewayMetrics())  # type: ignore[arg-type]
    accounts = q.rebuild({"t": {"weight": 4, "band": "interactive"}, "u": {"band": "batch"}}, [
        ActiveKey("k1", "h1", "t", {}), ActiveKey("k2", "h2", "t", {"weight": 8}),
        ActiveKey("k3", "h3", "t", {"weight": 0.5, "band": "batch"}), ActiveKey("k4", "h4", "u", {"weight": 2}),
        ActiveKey("k5", "h5", None, {"weight": 3})])
    shares = {k: share_of(a, 10) for k, a in accounts.items()}
    assert [(s.flow, s.weight, s.band) for s in shares.values()] == [
        (("tenant", "t"), 4, INTERACTIVE), (("tenant", "t"), 4, INTERACTIVE), (("tenant", "t"), 0.5, BATCH),
        (("tenant", "u"), 1, BATCH), (("key", "k5"), 3, INTERACTIVE)]
    anonymous = share_of(None, 0)
    assert anonymous.flow == SHARED_FLOW and anonymous.weight == 1 and anonymous.cost == 1


def test_a_request_costs_its_prompt_and_what_it_may_generate_in_tokens():
    bound = OutputBound(4096, "context")
    assert request_cost({"max_tokens": 100}, 400, bound) == 200
    assert request_cost({"max_tokens": 100, "n": 3}, 0, bound) == 300
    assert request_cost({"n_predict": 7, "best_of": 2, "n": 1}, 1, bound) == 15
    assert request_cost({}, 8, bound) == 4098


@pytest.mark.parametrize("limits", [
    {"weight": 0}, {"weight": -1}, {"weight": math.nan}, {"weight": math.inf}, {"weight": 1e300}, {"weight": 101},
    {"weight": 0.001}, {"weight": "2"}, {"weight": True}, {"weight": [1]}, {"band": "bulk"}, {"band": "Batch"},
    {"band": 1}, {"band": ""},
])
def test_bad_weights_and_bands_are_refused_naming_the_field(limits):
    with pytest.raises(ValidationError) as e:
        Limits.model_validate(limits)
    assert e.value.errors()[0]["loc"][0] == next(iter(limits))


def test_weights_and_bands_that_are_accepted_and_how_they_are_stored():
    assert Limits.model_validate({"weight": 2, "band": "batch"}).stored() == {"weight": 2.0, "band": "batch"}
    assert Limits.model_validate({"weight": 0.01}).weight == 0.01 and Limits(weight=100).weight == 100
    assert Limits.model_validate({"weight": None, "band": None}).empty


async def test_headroom_lets_a_flow_with_nothing_waiting_past_a_backlog_and_goes_back_when_freed():
    g = Gate("m", ModelLimits(max_concurrency=2, max_queue=100, queue_timeout_s=60, headroom=1))
    assert g.try_acquire() and g.try_acquire()
    w = Waiting(g)
    for i in range(3):
        await w.add(f"h{i}", Share(("tenant", "h")))
    assert g.queued == 2 and g.active == 3  # h0 took the headroom (nothing of h waited), h1 and h2 wait
    await w.add("l", Share(("tenant", "l")))
    assert w.served == ["h0"] and g.queued == 3  # the headroom is taken: l waits, first in line
    await w.add("batch", Share(("tenant", "b"), band=BATCH))  # batch never takes headroom
    g.release()  # 3 in flight, over the 2: this slot goes back to the headroom
    await asyncio.sleep(0)
    assert g.active == 2 and w.served == ["h0"]
    assert await w.serve(1) == ["l"]  # h was charged for h0: l's start tag is the smallest
    assert g.active == 2
    await w.add("l2", Share(("tenant", "l")))  # nothing of l waits: straight through the headroom again
    assert w.served[-1] == "l2" and g.active == 3
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)


def test_the_headroom_setting_is_checked():
    from llmgw.catalog.loader import CatalogError, parse_catalog
    for bad in (-1, 10**7, 1.5, "many"):
        with pytest.raises(CatalogError, match="limits.headroom"):
            parse_catalog({"models": [{"name": "m", "endpoints": ["http://m"], "limits": {"headroom": bad}}]})
    assert parse_catalog({"models": [{"name": "m", "endpoints": ["http://m"]}]}).models[0].limits is None


def test_ctl_takes_weight_and_band_and_refuses_a_weight_that_is_not_a_number(capsys):
    import typer

    from llmgw.ctl.tenants import limits_body, limits_text

    assert limits_body(None, None, None, None, None, "2.5", "batch") == {"weight": 2.5, "band": "batch"}
    assert limits_body(None, None, None, None, None, "none", "none") == {"weight": None, "band": None}
    for text in ("nan", "inf", "heavy", ""):
        with pytest.raises(typer.Exit):
            limits_body(None, None, None, None, None, text, None)
        assert "--weight" in capsys.readouterr().err
    assert limits_text({"weight": 2.0, "band": "batch"}) == "weight 2, band batch"


async def test_engines_queueing_lower_the_slots_to_what_they_run_and_an_empty_queue_grows_them_back():
    """The engines' own queues (gateway/engine_queues.py): with 6 of this gateway's requests in flight and 4
    waiting inside the engines, the slots become 2 and the next requests wait at the gateway, in fair
    queues; while requests wait here and the engines queue nothing, the slots grow back (a quarter, at
    least one, a reading) up to `max_concurrency`, and those waiting take the new slots in fair order."""
    g = gate(slots=8, queue=50)
    assert g.learns
    for _ in range(6):
        assert g.try_acquire()
    assert g.engines_waiting(4) and g.max_concurrency == 2
    assert not g.try_acquire()  # 6 in flight over 2 slots: a newcomer waits here, not in an engine
    w = Waiting(g)
    await w.add("heavy-1", Share(("tenant", "heavy"), cost=10))
    await w.add("heavy-2", Share(("tenant", "heavy"), cost=10))
    await w.add("light", Share(("tenant", "light"), cost=10))
    assert await w.serve(4) == []  # those in flight end: 6 -> 2, no slot handed on until they are under 2
    assert await w.serve(1) == ["heavy-1"]
    assert g.engines_waiting(0) and g.max_concurrency == 3  # waiters here, engines empty, slots all taken: grow
    await asyncio.sleep(0)
    assert w.served == ["heavy-1", "light"], w.served  # the new slot, to the light flow first (fair order)
    assert g.engines_waiting(0) and g.max_concurrency == 4
    await asyncio.sleep(0)
    assert w.served == ["heavy-1", "light", "heavy-2"], w.served
    for _ in range(10):
        assert not g.engines_waiting(0)  # nobody waits here any more: nothing to grow for
    assert g.max_concurrency == 4 and g.active == 4


async def test_a_gate_without_a_queue_is_left_to_its_engines_and_growth_stops_at_the_ceiling():
    g = Gate("m", ModelLimits(max_concurrency=4))  # no max_queue: lowering it would only refuse requests
    assert not g.learns
    unbounded = Gate("m", ModelLimits(max_queue=10))
    assert unbounded.learns and unbounded.max_concurrency == unbounded.ceiling == 1 << 30
    for _ in range(3):
        assert unbounded.try_acquire()
    assert unbounded.engines_waiting(1) and unbounded.max_concurrency == 2
    assert not unbounded.engines_waiting(0)  # nobody waits here: the slots stay as learned
    g = gate(slots=3, queue=10)
    for _ in range(3):
        g.try_acquire()
    assert g.engines_waiting(2) and g.max_concurrency == 1
    w = Waiting(g)
    for i in range(5):
        await w.add(f"r{i}", Share(("tenant", "t"), cost=1))
    await w.serve(2)  # 3 in flight -> 1
    seen = []
    for _ in range(6):
        g.engines_waiting(0)
        seen.append(g.max_concurrency)
    assert seen[:2] == [2, 3] and set(seen[2:]) == {3}, seen  # +1 while small, never past max_concurrency
    for t in w.tasks:  # (the rest still wait: the session's loop would time them out in a later test)
        t.cancel()


@pytest.mark.parametrize("engine, page, expected", [
    ("vllm", 'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\nvllm:num_requests_running{engine="0"} 8.0\n', 3),
    ("vllm", 'vllm:num_requests_waiting{engine="0"} 2.0\nvllm:num_requests_waiting{engine="1"} 1.0\n', 3),
    ("sglang", "sglang:num_queue_reqs{model_name=\"m\"} 5\n", 5),
    ("llamacpp", "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n", 1),
    ("sim", "sim:num_requests_waiting 0\n", 0),
    ("unknown", "vllm:num_requests_waiting 4\n", 4),  # a static endpoint: whichever gauge its page has
    ("vllm", "vllm:num_requests_running 4\n", None),  # no waiting gauge: it says nothing
    ("vllm", "vllm:num_requests_waiting NaN\n", None),
    ("vllm", "vllm:num_requests_waiting -1\n", None),
    ("sglang", "<html>not metrics</html>", None),
])
def test_an_engines_queue_is_read_from_its_own_gauge(engine, page, expected):
    from llmgw.engines.queue_gauges import waiting
    assert waiting(engine, page) == expected
