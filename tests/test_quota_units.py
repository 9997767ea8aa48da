"""Unit tests of tenants' limits (issue 15): the bucket arithmetic (gateway/buckets.py), reading usage out
of answers (gateway/tokens.py), the limits' validation (schemas/tenants.py), and one gateway's admission
and fleet sync (gateway/quotas.py) with the database replaced by the totals it would return. The real path,
two gateways on one Postgres, is in tests/test_tenants.py."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from llmgw.db.keys_repo import ActiveKey
from llmgw.db.usage_repo import MinuteTotal, PeriodTotal
from llmgw.gateway.buckets import Budget, Window, duration_text, period_bounds, reset_header
from llmgw.http.errors import APIError
from llmgw.gateway.quotas import Quotas
from llmgw.gateway.tokens import ask_usage, counts, read_events, usage_of_body
from llmgw.schemas.catalog import Model
from llmgw.schemas.tenants import Limits, TenantCreate, pattern_problem, tenant_name_problem
from llmgw.telemetry import GatewayMetrics

T0 = 1_700_000_040.0  # 40 s into a minute (1_700_000_000 is 20 s into one)


def ts(y, m, d, h=0):
    return datetime(y, m, d, h, tzinfo=timezone.utc).timestamp()


# ---- windows -------------------------------------------------------------------------------------

def test_a_window_admits_up_to_its_limit_then_waits_for_the_previous_minute_to_fade():
    w = Window(limit=10)
    start = T0 // 60 * 60
    for _ in range(10):
        assert w.room(start + 1, 1)
        w.add(1, start + 1)
    assert not w.room(start + 1, 1)
    assert w.remaining(start + 1) == 0
    # Within the minute nothing fades: the wait reaches into the next minute, until cur·(1 − e/60) ≤ 9.
    assert w.wait_s(start + 1, 1) == pytest.approx(59 + 60 * (1 - 9 / 10))
    # In the next minute the previous one's share falls linearly: 10 · (1 − 6/60) = 9 -> room for one at +6 s.
    assert not w.room(start + 60 + 5.9, 1)
    assert w.room(start + 60 + 6.0, 1)
    assert w.used(start + 60 + 30) == pytest.approx(5)
    assert w.remaining(start + 60 + 30) == 5
    # Two minutes later nothing is counted.
    assert w.used(start + 180) == 0 and w.reset_s(start + 180) == 0


def test_a_window_never_admits_twice_its_limit_across_a_minute_boundary():
    """What fixed windows get wrong: a full minute just before the boundary and another just after."""
    w = Window(limit=100)
    start = T0 // 60 * 60
    admitted = 0
    t = start + 50.0
    while t < start + 70.0:  # 20 s straddling the boundary, a request every 10 ms
        if w.room(t, 1):
            w.add(1, t)
            admitted += 1
        t += 0.01
    assert 100 <= admitted <= 100 + 100 * 10 / 60 + 1  # the previous minute fades by 10/60 within 10 s


def test_a_token_window_admits_while_not_exhausted_and_counts_after():
    w = Window(limit=1000)
    start = T0 // 60 * 60
    w.add(999, start + 1)
    assert w.room(start + 1, 0)  # one token left: a request may still start
    w.add(5000, start + 1)  # ... and its answer is counted in full, afterwards
    assert not w.room(start + 1, 0)
    assert w.remaining(start + 1) == 0
    # cur 5999 alone is over: room once 5999 · (1 − e/60) < 1000 in the next minute
    assert w.wait_s(start + 1, 0) == pytest.approx(59 + 60 * (1 - 1000 / 5999))


def test_the_wait_of_a_fading_previous_minute():
    w = Window(limit=10)
    start = T0 // 60 * 60
    w.synced(start, prev=20, cur=2)  # 20 in the previous minute, 2 in this one
    e = 15.0
    # need prev·(1 − e'/60) + 2 ≤ 9  ->  e' = 60 · (1 − 7/20) = 39 s into the minute
    assert w.wait_s(start + e, 1) == pytest.approx(39 - e)
    assert not w.room(start + 38.9, 1) and w.room(start + 39.0, 1)
    assert w.reset_s(start + e) == pytest.approx(120 - e)
    left, reset = w.report(start + e)
    assert left == w.remaining(start + e) == 0 and reset == w.reset_s(start + e)
    assert w.report(start + 50) == (w.remaining(start + 50), w.reset_s(start + 50)) == (4, 70)  # 20 · (1 − 50/60) + 2 = 5.3 used


def test_no_limit_counts_and_never_refuses():
    w = Window()
    w.add(10**9, T0)
    assert w.room(T0, 1) and w.wait_s(T0, 1) == 0 and w.remaining(T0) == 0


def test_the_sync_keeps_what_was_counted_while_it_ran_and_restores_what_it_failed_to_write():
    w = Window(limit=100)
    start = T0 // 60 * 60
    w.add(3, start + 1)
    sent = w.taken()
    assert sent == 3
    w.add(2, start + 1)  # admitted while the sync's query ran
    w.synced(start, prev=10, cur=40)  # the fleet, this gateway's 3 included
    assert w.cur == 42 and w.prev == 10
    w.add(1, start + 1)
    sent = w.taken()
    assert sent == 3  # the 2 counted while the last query ran were not in its write: they go in this one
    w.restore(sent)  # the write failed: written at the next sync
    assert w.unsynced == 3


def test_budgets_last_until_the_period_turns():
    b = Budget("day", lambda now: period_bounds("day", now), limit=1000)
    noon = ts(2025, 3, 4, 12)
    assert b.room(noon)
    b.add(1000, noon)
    assert not b.room(noon)
    assert b.wait_s(noon) == pytest.approx(12 * 3600)
    assert b.room(ts(2025, 3, 5) + 1)  # the next UTC day
    assert b.used_now(ts(2025, 3, 5) + 1) == 0


def test_period_bounds_days_months_and_the_test_day():
    assert period_bounds("day", ts(2025, 3, 4, 13)) == (ts(2025, 3, 4), ts(2025, 3, 5))
    assert period_bounds("month", ts(2025, 3, 4, 13)) == (ts(2025, 3, 1), ts(2025, 4, 1))
    assert period_bounds("month", ts(2024, 12, 31, 23)) == (ts(2024, 12, 1), ts(2025, 1, 1))
    assert period_bounds("month", ts(2024, 2, 29, 23)) == (ts(2024, 2, 1), ts(2024, 3, 1))
    assert period_bounds("day", 1000.0, day_s=8) == (1000.0, 1008.0)
    assert period_bounds("day", 1007.9, day_s=8) == (1000.0, 1008.0)
    with pytest.raises(ValueError):
        period_bounds("week", T0)


def test_durations_are_written_as_openai_writes_them():
    assert [duration_text(s) for s in (0, 0.02, 0.9994, 1, 1.5, 59.25, 60, 360, 3723.5)] == \
        ["0ms", "20ms", "999ms", "1s", "1.5s", "59.25s", "1m0s", "6m0s", "1h2m3.5s"]
    assert [reset_header(s) for s in (0.02, 1, 1.2, 59.5, 119.01)] == [b"20ms", b"1s", b"2s", b"1m0s", b"2m0s"]


# ---- usage in answers ----------------------------------------------------------------------------

def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_usage_of_a_body_is_its_top_level_usage_even_when_the_answer_talks_about_usage():
    body = {"id": "x", "choices": [{"message": {"content": 'the "usage": {"prompt_tokens": 99} field'}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
    assert usage_of_body(json.dumps(body).encode()) == (7, 5)
    assert usage_of_body(json.dumps(body, separators=(",", ":")).encode()) == (7, 5)
    assert usage_of_body(b'{"usage": null}') is None
    assert usage_of_body(b'{"choices": []}') is None
    emb = {"data": [], "usage": {"prompt_tokens": 4, "total_tokens": 4}}
    assert usage_of_body(json.dumps(emb).encode()) == (4, 0)


def test_counts_refuse_what_is_not_a_count_and_cap_wild_figures():
    assert counts({"prompt_tokens": 3, "completion_tokens": 2}) == (3, 2)
    assert counts({"prompt_tokens": -1, "completion_tokens": "2", "total_tokens": True}) is None
    assert counts({"prompt_tokens": 10**30, "completion_tokens": 1}) == ((1 << 31) - 1, 1)
    assert counts(None) is None and counts([1]) is None


def test_the_usage_chunk_is_stripped_only_when_asked_and_content_chunks_never():
    content = event({"choices": [{"delta": {"content": "α"}}], "usage": None})
    final = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}})
    out, found = read_events(content + final, strip=True)
    assert out == content and found == (3, 16)
    out, found = read_events(content + final, strip=False)
    assert out == content + final and found == (3, 16)
    out, found = read_events(final, strip=True)
    assert out == b"" and found == (3, 16)
    # llama.cpp-style: usage on the last content chunk: counted, relayed whole
    last = event({"choices": [{"delta": {"content": "ω"}, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert read_events(last, strip=True) == (last, (3, 2))
    # vLLM's continuous usage: a running total in each chunk; the last one is what was used
    run = b"".join(event({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 3,
                                                                              "completion_tokens": i}}) for i in (1, 2, 3))
    assert read_events(run, strip=True) == (run, (3, 3))
    assert read_events(content, strip=True) == (content, None)


def test_asking_for_usage_rewrites_only_what_it_must():
    req = {"model": "m", "messages": [], "stream": True}
    body = json.dumps(req).encode() + b"\n"
    req2, body2, strip = ask_usage(req, body)
    assert strip and json.loads(body2) == {**req, "stream_options": {"include_usage": True}} == req2
    asked = {**req, "stream_options": {"include_usage": True}}
    assert ask_usage(asked, b"{}") == (asked, b"{}", False)
    other = {**req, "stream_options": {"continuous_usage_stats": False}}
    req3, body3, strip = ask_usage(other, json.dumps(other).encode())
    assert strip and json.loads(body3)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    plain = {"model": "m", "messages": []}
    assert ask_usage(plain, b"x") == (plain, b"x", False)
    for bad, param in (({**req, "stream_options": "yes"}, "stream_options"),
                       ({**req, "stream_options": {"include_usage": 1}}, "stream_options.include_usage")):
        with pytest.raises(APIError) as e:
            ask_usage(bad, json.dumps(bad).encode())
        assert e.value.status == 400 and e.value.param == param


# ---- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["team-a", "a", "ml.research_2", "0" * 63])
def test_tenant_names_that_are_accepted(name):
    assert tenant_name_problem(name) is None


@pytest.mark.parametrize("name,says", [
    ("Team-A", "write 'team-a'"), ("ｔｅａｍ", "write 'team'"), (" team", "write 'team'"), ("team\n", "write 'team'"),
    ("", "1-63 characters"), ("-team", "starting with"), ("a" * 64, "1-63"), ("tëam", "tëam"), ("a/b", "a/b"),
    ("tеam", "1-63"),  # a Cyrillic е: no normal form makes it ASCII
])
def test_tenant_names_that_are_refused_say_why(name, says):
    why = tenant_name_problem(name)
    assert why is not None and says in why


@pytest.mark.parametrize("pattern,says", [
    ("", "non-empty"), ("a b", "characters"), ("llama[", "never closed"), ("a]", "without"), ("[]x", "empty set"),
    ("[!]", "empty set"), ("[a[b]]", "nest"), ("a!", "only allowed first"), ("x" * 257, "at most 256"),
    ("mod\u00e8le", "characters"),
])
def test_bad_model_patterns_are_refused(pattern, says):
    why = pattern_problem(pattern)
    assert why is not None and says in why


@pytest.mark.parametrize("pattern", ["llama-*", "team-?/[ab]*", "[!x]*", "Qwen/Qwen2.5-7B-Instruct", "*"])
def test_good_model_patterns(pattern):
    assert pattern_problem(pattern) is None


@pytest.mark.parametrize("limits,field", [
    ({"rpm": -1}, "rpm"), ({"rpm": 0}, "rpm"), ({"rpm": 1.5}, "rpm"), ({"rpm": "10"}, "rpm"), ({"rpm": True}, "rpm"),
    ({"rpm": 10**8}, "rpm"), ({"tpm": 10**12}, "tpm"), ({"tokens_per_day": 10**16}, "tokens_per_day"),
    ({"tokens_per_month": -5}, "tokens_per_month"), ({"models": []}, "models"), ({"models": ["ok", "bad pattern"]}, "models"),
    ({"models": ["a"] * 65}, "models"), ({"models": "llama-*"}, "models"), ({"rpn": 5}, "rpn"),
])
def test_bad_limits_are_refused_naming_the_field(limits, field):
    with pytest.raises(ValidationError) as e:
        Limits.model_validate(limits)
    assert e.value.errors()[0]["loc"][0] == field


def test_a_limits_update_changes_only_what_it_names_and_null_removes():
    base = Limits(rpm=60, tpm=1000, models=["a*"])
    change = Limits.model_validate({"rpm": None, "tokens_per_day": 5})
    assert base.updated(change).stored() == {"tpm": 1000, "tokens_per_day": 5, "models": ["a*"]}
    with pytest.raises(ValidationError):
        TenantCreate.model_validate({"name": "Team"})


# ---- one gateway's admission and sync, the database's answers given --------------------------------

def quotas_with(tenant_limits: dict, key_limits: dict | None = None, tenant: str | None = "team") -> tuple[Quotas, object]:
    q = Quotas(engine=None, metrics=GatewayMetrics())  # type: ignore[arg-type]
    tenants = {tenant: tenant_limits} if tenant else {}
    accounts = q.rebuild(tenants, [ActiveKey("k1", "h1", tenant, key_limits or {})])
    return q, accounts["k1"]


MODEL = Model(name="llama-8b", aliases=["small"], endpoints=["http://127.0.0.1:9"])
OTHER = Model(name="judge", endpoints=["http://127.0.0.1:9"])
REQ = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]}


def test_admission_refuses_over_the_rpm_with_retry_after_and_openai_headers(monkeypatch):
    q, acct = quotas_with({"rpm": 3})
    q.clock = lambda: T0
    for i in range(3):
        meter, _, _ = q.admit(acct, MODEL, REQ, b"{}")
        headers = dict(meter.headers)
        assert headers[b"x-ratelimit-limit-requests"] == b"3"
        assert headers[b"x-ratelimit-remaining-requests"] == str(2 - i).encode()
    with pytest.raises(APIError) as e:
        q.admit(acct, MODEL, REQ, b"{}")
    err = e.value
    assert (err.status, err.type, err.code) == (429, "rate_limit_exceeded", "rate_limit_exceeded")
    assert "tenant `team`" in err.message and "limit 3" in err.message
    assert int(err.headers["Retry-After"]) >= 1 and err.headers["x-ratelimit-remaining-requests"] == "0"
    assert q.pending == {("team", "k1", "llama-8b"): [3, 0, 0]}  # the refused one is not counted


def test_tokens_are_counted_after_the_answer_and_spent_budgets_get_insufficient_quota(monkeypatch):
    q, acct = quotas_with({"tokens_per_day": 100}, key_limits={"tpm": 10_000})
    q.clock = lambda: T0
    meter, _, _ = q.admit(acct, MODEL, REQ, b"{}")
    meter.body(json.dumps({"usage": {"prompt_tokens": 30, "completion_tokens": 80}}).encode())
    q.settle(meter)  # 110 of 100: the request was admitted while budget was left, and counted in full
    assert q.pending[("team", "k1", "llama-8b")] == [1, 30, 80]
    with pytest.raises(APIError) as e:
        q.admit(acct, MODEL, REQ, b"{}")
    err = e.value
    assert (err.status, err.type, err.code) == (429, "insufficient_quota", "insufficient_quota")
    day_end = period_bounds("day", T0)[1]
    assert int(err.headers["Retry-After"]) == pytest.approx(day_end - T0, abs=1)
    assert err.headers["x-should-retry"] == "false" and "110 of 100" in err.message
    # the key's own tpm is reported on the way (the tightest window with a limit)
    assert err.headers["x-ratelimit-limit-tokens"] == "10000" and err.headers["x-ratelimit-remaining-tokens"] == "9890"
    q.clock = lambda: day_end + 1  # the day turns
    q.admit(acct, MODEL, REQ, b"{}")


def test_models_are_allowed_by_name_alias_or_pattern_on_both_tenant_and_key():
    q, acct = quotas_with({"models": ["llama-*", "judge"]}, key_limits={"models": ["small"]})
    assert acct.refusing(MODEL) is None  # tenant by pattern, key by alias
    refusing = acct.refusing(OTHER)  # the tenant allows it, the key does not
    assert refusing is not None and refusing.who == "key `k1`"
    with pytest.raises(APIError) as e:
        q.admit(acct, OTHER, REQ, b"{}")
    assert (e.value.status, e.value.code, e.value.param) == (403, "model_not_allowed", "model")
    assert "small" in e.value.message


async def test_the_sync_writes_this_gateways_counts_and_takes_the_fleets(monkeypatch):
    """Two keys of one tenant with 10 rpm; this gateway admitted one request, and the database says the
    fleet made 9 this minute and 30 the minute before: the next is refused here, and what was written is
    this gateway's own count."""
    q = Quotas(engine=None, metrics=GatewayMetrics())  # type: ignore[arg-type]
    accts = q.rebuild({"team": {"rpm": 10}}, [ActiveKey("k1", "h1", "team", {}), ActiveKey("k2", "h2", "team", {})])
    minute = T0 // 60 * 60
    written = {}

    class Conn:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    class Engine:
        def begin(self):
            return Conn()

    async def db_now(conn):
        return T0

    async def add(conn, m, periods, rows):
        written.update(rows)
        assert m == minute and periods["day"] == period_bounds("day", T0)[0]

    async def claim(conn, ids):
        return set(ids)  # none written before

    async def totals(conn, since, periods, holds):
        assert since == minute - 60
        assert holds.held == {} and not holds.write  # nothing held here (the tenant has no token limit)
        return ([MinuteTotal("team", "k1", minute, 5, 100), MinuteTotal("team", "k2", minute, 4, 50),
                 MinuteTotal("team", "k2", minute - 60, 30, 0)], [PeriodTotal("team", "k1", "day", 150)], [])

    from llmgw.db import usage_repo
    monkeypatch.setattr(usage_repo, "db_now", db_now)
    monkeypatch.setattr(usage_repo, "add", add)
    monkeypatch.setattr(usage_repo, "totals", totals)
    monkeypatch.setattr(usage_repo, "claim", claim)
    q.engine = Engine()  # type: ignore[assignment]
    q.clock = lambda: T0 - 5  # this host's clock is 5 s behind the database's
    q.admit(accts["k1"], MODEL, REQ, b"{}")
    await q.sync()
    assert written == {("team", "k1", "llama-8b"): [1, 0, 0]} and q.pending == {}
    assert q.offset == pytest.approx(5)
    tenant = q.scopes[("tenant", "team")]
    assert tenant.requests.cur == 9 and tenant.requests.prev == 30 and tenant.day.used == 150
    # used = 30 · (1 − 40/60) + 9 = 19 > 10: refused, although this gateway itself admitted only one
    with pytest.raises(APIError):
        q.admit(accts["k2"], MODEL, REQ, b"{}")


def test_a_request_refused_by_the_key_is_not_counted_against_its_tenant():
    q, acct = quotas_with({"rpm": 100}, key_limits={"rpm": 1})
    q.clock = lambda: T0
    meter, _, _ = q.admit(acct, MODEL, REQ, b"{}")
    # both have an rpm: the headers come from the tighter one, the key's, with none left
    assert dict(meter.headers)[b"x-ratelimit-limit-requests"] == b"1"
    assert dict(meter.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(APIError) as e:
        q.admit(acct, MODEL, REQ, b"{}")
    assert "key `k1`" in e.value.message
    tenant, key = acct.quotas
    assert tenant.requests.cur == 1 and key.requests.cur == 1 and tenant.requests.unsynced == 1
    assert q.pending[("team", "k1", "llama-8b")] == [1, 0, 0]


def test_an_answer_without_usage_is_charged_an_estimate_and_one_never_answered_nothing():
    q, acct = quotas_with({"tokens_per_day": 10**9})
    q.clock = lambda: T0
    stream = {**REQ, "stream": True, "max_tokens": 500}
    never, _, _ = q.admit(acct, MODEL, stream, b"{}")  # refused by the engine, or held through a failed load
    never.prompt_chars = 400
    q.settle(never)
    assert q.pending[("team", "k1", "llama-8b")] == [1, 0, 0]
    left, _, _ = q.admit(acct, MODEL, stream, b"{}")  # the client left after 12 events
    left.prompt_chars, left.relayed = 400, 12
    q.settle(left)
    assert q.pending[("team", "k1", "llama-8b")] == [2, 100, 12]
    whole, _, _ = q.admit(acct, MODEL, {**REQ, "max_tokens": 50}, b"{}")  # a 200 body without usage
    whole.prompt_chars = 9
    whole.body(b'{"choices": []}')
    q.settle(whole)
    assert q.pending[("team", "k1", "llama-8b")] == [3, 103, 62]


def test_what_requests_in_flight_may_use_is_held_and_released_whatever_becomes_of_them():
    """Admission holds a token for each 4 characters of prompt plus max_tokens in every quota of the
    account; the token limits judge used + held; settling releases the hold, answered or not, and a
    request refused by its key's quota holds nothing in its tenant's."""
    q, acct = quotas_with({"tokens_per_day": 100}, key_limits={"rpm": 2})
    tenant, own = acct.quotas
    q.clock = lambda: T0
    req = {**REQ, "max_tokens": 40}
    a, _, _ = q.admit(acct, MODEL, req, b"{}", prompt_chars=8)  # holds 2 + 40
    b, _, _ = q.admit(acct, MODEL, req, b"{}", prompt_chars=8)
    assert tenant.held == own.held == 84 and a.held == b.held == 42
    with pytest.raises(APIError) as e:  # the key's rpm refuses it: nothing held, nothing counted for it
        q.admit(acct, MODEL, req, b"{}", prompt_chars=8)
    assert "key `k1`" in e.value.message and tenant.held == 84
    q.settle(a)  # answered with no usage and never sent: charged nothing, its hold released
    assert tenant.held == own.held == 42 and tenant.day.used == 0
    b.body(json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 40}}).encode())
    q.settle(b)
    q.settle(b)  # (settled twice by mistake: the hold is not released twice)
    assert tenant.held == own.held == 0 and tenant.day.used == 84


def test_a_budget_filled_by_holds_is_a_rate_limit_for_a_second_not_a_spent_quota():
    q, acct = quotas_with({"tokens_per_day": 100, "tpm": 1000})
    q.clock = lambda: T0
    held, sent = [], []
    for _ in range(3):  # 0, 41 and 82 held are under 100, so three are admitted
        meter, req, _ = q.admit(acct, MODEL, {**REQ, "max_tokens": 40}, b"{}", prompt_chars=2)
        held.append(meter)
        sent.append(req["max_tokens"])
    # the third is cut to what the budget leaves it (100 - 82 held - 1 of prompt), so it holds 18, not 41
    assert sent == [40, 40, 17] and [m.held for m in held] == [41, 41, 18]
    with pytest.raises(APIError) as e:
        q.admit(acct, MODEL, REQ, b"{}", prompt_chars=2)
    err = e.value
    assert (err.status, err.code) == (429, "rate_limit_exceeded") and err.headers["Retry-After"] == "1"
    assert "0 of 100 tokens used, 100 held by requests in flight" in err.message, err.message
    for m in held:
        m.body(json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 40}}).encode())
        q.settle(m)
    with pytest.raises(APIError) as e:  # now spent, until the day turns
        q.admit(acct, MODEL, REQ, b"{}", prompt_chars=2)
    assert e.value.code == "insufficient_quota"


def test_a_request_whose_prompt_reached_an_engine_is_charged_it_though_no_answer_came():
    q, acct = quotas_with({"tokens_per_month": 10**6})
    q.clock = lambda: T0
    m, _, _ = q.admit(acct, MODEL, {**REQ, "max_tokens": 60}, b"{}", prompt_chars=8000)
    m.sent = True  # the proxy: the engine (or a guard's judge) has it; then the client left
    q.settle(m)
    assert q.pending[("team", "k1", "llama-8b")] == [1, 2000, 0]


def test_a_reservation_counts_every_choice_and_the_larger_of_n_and_best_of():
    """Issue 37: `n` and `best_of` multiply what an engine generates, and so what is held."""
    q, acct = quotas_with({"tokens_per_month": 10**6})
    q.clock = lambda: T0
    one, _, _ = q.admit(acct, MODEL, {**REQ, "max_tokens": 10}, b"{}", prompt_chars=4)
    four, _, _ = q.admit(acct, MODEL, {**REQ, "max_tokens": 10, "n": 4}, b"{}", prompt_chars=4)
    best, req, body = q.admit(acct, MODEL, {**REQ, "max_tokens": 10, "n": 2, "best_of": 5}, b"{}", prompt_chars=4)
    assert (one.held, four.held, best.held) == (11, 41, 51) and best.cap == 50
    assert body == b"{}" and req["max_tokens"] == 10  # its own cap fits: sent as it came


def test_a_whole_answer_without_usage_is_charged_the_cap_its_engine_was_told_and_no_more():
    """An answer without usage is charged the max_tokens the engine was told; a request without one, to a
    model whose engine stops at its context (nothing sent), is charged its prompt only, as before: what is
    reserved for it is not what it is billed."""
    q, acct = quotas_with({"tokens_per_month": 400_000})
    q.clock = lambda: T0
    untold, req, body = q.admit(acct, MODEL, REQ, b"{}", prompt_chars=4)
    assert untold.held == 1 + 10_485_760 // 32 and "max_tokens" not in req and body == b"{}"
    cut, req, _ = q.admit(acct, MODEL, {**REQ, "n": 2}, b"{}", prompt_chars=4)  # cut to the budget's share
    assert req["max_tokens"] == (400_000 - untold.held - 1) // 2 and cut.cap == 2 * req["max_tokens"]
    for m in (untold, cut):
        m.body(b'{"choices": []}')
        q.settle(m)
    assert q.pending[("team", "k1", "llama-8b")] == [2, 2, cut.cap]
