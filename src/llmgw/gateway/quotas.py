"""Tenants' and keys' limits, enforced in each gateway's memory and reconciled fleet-wide every second
(issue 15). The arithmetic is in gateway/buckets.py, reading `usage` from answers in gateway/tokens.py.

A key is *accounted* when it belongs to a tenant or has limits of its own; only accounted keys are counted
and limited, and only their requests pay for it (a dict lookup, a few compares and additions, no I/O and
no task per request). A key of neither kind, or no key at all, takes the path it took before tenants.

- Admission before the body (`refusal`, as the headers arrive): the requests per minute, tokens per
  minute and budgets, without counting, so a key refused for them is refused without its body being read.
- Admission (`admit`, before routing): the model must be one the tenant and the key allow (else 403
  `model_not_allowed`), then for the tenant and for the key: requests per minute with room for one more,
  tokens per minute not exhausted, the day's and the month's budgets not spent; else 429
  `rate_limit_exceeded` / `insufficient_quota` with Retry-After and OpenAI's `x-ratelimit-*` headers. The
  request is counted at once, so this gateway's next request sees it, and what it may use (a token per 4
  characters of prompt, plus its max_tokens, as OpenAI counts it) is held in its quotas until it ends: the
  token limits judge what was used plus what requests in flight hold, on this gateway now and on the others
  as of the last sync, so a burst admitted at once cannot all pass a budget before the first answer is
  counted, on one gateway or across the fleet.
- The answer's `usage` is read as it passes (`Meter`), and counted once when the request ends (`settle`),
  under the model the client asked for (its catalog name). A request that ends without usage (the engine
  broke off, the client left) is charged an estimate once its prompt reached an engine or a guard's
  judge (`settle`), and counted in `llmgw_usage_missing_total`.
- Every `sync_s` (`sync`): this gateway's counts since the last sync are added to Postgres (one usage row
  per minute, tenant, key and model; one per budget period and key), and the fleet's totals for the last
  two minutes, the day and the month are read back in the same transaction, from the database clock. If
  Postgres cannot be reached, the counts are kept, each batch under the minute it was counted in, and
  written to those minutes and their budget periods at the next sync (not all into the minute Postgres
  came back in, which would have shut every tenant that kept working out of its rpm); limits are judged
  meanwhile by the last fleet totals plus this gateway's own traffic. Each batch of counts carries an id
  recorded with it, so a sync whose COMMIT reached Postgres but whose answer was lost is not added again
  when it is retried (issue 37: a bill counted twice). The same transaction replaces this gateway's row of
  holds (what its requests in flight hold per tenant and key) and reads the other gateways' (`Quota.others`),
  which count until `HOLDS_FRESH_SYNCS` sync intervals after their gateway's last sync (issue 37).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from datetime import datetime, timezone
from operator import attrgetter

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.catalog.context import OutputBound, output_bound, prompt_bound
from llmgw.db import usage_repo
from llmgw.db.keys_repo import ActiveKey
from llmgw.http import errors
from llmgw.gateway.buckets import WINDOW_S, Budget, Window, duration_text, period_bounds, reset_header
from llmgw.gateway.tokens import Counts, ask_usage, read_events, usage_of_body
from llmgw.http.response_head import head_lines
from llmgw.schemas.catalog import Model
from llmgw.schemas.tenants import NO_TENANT, Limits, model_allowed
from llmgw.telemetry import GatewayMetrics

log = logging.getLogger(__name__)
CHARS_PER_TOKEN = 4  # an answer without usage is charged a token for every 4 characters of its prompt
_REQUEST_LINES = b"x-ratelimit-limit-requests: %s\r\nx-ratelimit-remaining-requests: %d\r\nx-ratelimit-reset-requests: %s\r\n"
_TOKEN_LINES = b"x-ratelimit-limit-tokens: %s\r\nx-ratelimit-remaining-tokens: %d\r\nx-ratelimit-reset-tokens: %s\r\n"
_BOTH_LINES = _REQUEST_LINES + _TOKEN_LINES
_UNSEEN = object()  # a model not judged yet for an account
# The other gateways count this gateway's holds for this many sync intervals after each of its syncs: a
# sync delayed by a few seconds (a slow Postgres) keeps them; a gateway that died holds nothing after it.
HOLDS_FRESH_SYNCS = 10


class Quota:
    """One scope's limits and its fleet-wide counts: a tenant's (shared by every key of it) or a key's own."""

    __slots__ = ("scope", "name", "limits", "metered", "requests", "tokens", "day", "month", "held", "others",
                 "requests_left", "requests_reset", "tokens_left", "tokens_reset")

    def __init__(self, scope: str, name: str, day_s: float | None):
        self.scope = scope  # "tenant" or "key"
        self.name = name
        self.limits = Limits()
        self.metered = False  # a limit on tokens: per minute, or a budget
        self.requests = Window()
        self.tokens = Window()
        self.day = Budget("day", lambda now: period_bounds("day", now, day_s))
        self.month = Budget("month", lambda now: period_bounds("month", now))
        # Tokens the requests in flight on this gateway may still use (`Meter.held`, reserved at admission,
        # released when each settles): judged with the tokens already counted, in the window and both budgets.
        self.held = 0
        # Tokens the requests in flight on the other gateways hold, as of the last sync (`Quotas.sync`):
        # judged with this gateway's own, so that N gateways cannot each admit what is left.
        self.others = 0
        # As of this scope's last admission (`take`): what the `x-ratelimit-*` headers say.
        self.requests_left = self.tokens_left = 0
        self.requests_reset = self.tokens_reset = 0.0

    @property
    def who(self) -> str:
        return f"tenant `{self.name}`" if self.scope == "tenant" else f"key `{self.name}`"

    def set(self, limits: Limits) -> None:
        self.limits = limits
        self.requests.limit, self.tokens.limit = limits.rpm, limits.tpm
        self.day.limit, self.month.limit = limits.tokens_per_day, limits.tokens_per_month
        self.metered = limits.tpm is not None or limits.tokens_per_day is not None or limits.tokens_per_month is not None

    def take(self, now: float) -> bool:
        """Count one request if it fits (the arithmetic of `Window.room`, `.add` and `.report` written
        out: every request of an accounted key comes here), keeping what the headers will say; False, and
        nothing counted, if it does not fit."""
        r = self.requests
        if now >= r.start + WINDOW_S:
            r.report(now)  # rolls the window forward
        e = now - r.start
        used = r.prev * (1.0 - e / WINDOW_S) + r.cur
        limit = r._limit
        if limit is not None and used + 1 > limit:
            return False
        if self.metered:
            held = self.held + self.others
            t = self.tokens
            if t._limit is not None:
                if now >= t.start + WINDOW_S:
                    t.report(now)  # rolls the window forward
                te = now - t.start
                tused = t.prev * (1.0 - te / WINDOW_S) + t.cur + held
                if tused >= t._limit:
                    return False
                self.tokens_left = int(t._limit - tused)
                self.tokens_reset = 2 * WINDOW_S - te if t.cur else WINDOW_S - te if t.prev else 0.0
            if not (self.day.room(now, held) and self.month.room(now, held)):
                return False
        r.cur += 1
        r.unsynced += 1
        if limit is not None:
            left = limit - used - 1
            self.requests_left = int(left) if left > 0 else 0
            self.requests_reset = 2 * WINDOW_S - e
        return True

    def fits(self, now: float) -> bool:
        """Whether `take` would count one more request now, counting nothing: the requests per minute have
        room for one, the tokens per minute are not exhausted, neither budget is spent (what requests in
        flight hold counted as used). For admission before the body is read (`Quotas.refusal`)."""
        r = self.requests
        if r._limit is not None and not r.room(now, 1):
            return False
        if self.metered:
            held = self.held + self.others
            t = self.tokens
            if t._limit is not None and t.used(now) + held >= t._limit:
                return False
            if not (self.day.room(now, held) and self.month.room(now, held)):
                return False
        return True

    def untake(self) -> None:
        """Undo `take` (another quota of the same request refused it)."""
        self.requests.cur -= 1
        self.requests.unsynced -= 1

    def spend(self, n: int, now: float) -> None:
        """`n` tokens used: in the minute's window (its `add`, written out) and both budgets."""
        t = self.tokens
        if now >= t.start + WINDOW_S:
            t.report(now)  # rolls the window forward
        t.cur += n
        t.unsynced += n
        self.day.add(n, now)
        self.month.add(n, now)

    def taken(self) -> tuple[int, int, int, int]:
        return self.requests.taken(), self.tokens.taken(), self.day.taken(), self.month.taken()

    def restore(self, t: tuple[int, int, int, int]) -> None:
        for part, n in zip((self.requests, self.tokens, self.day, self.month), t):
            part.restore(n)


def _held_text(q: Quota) -> str:
    held = q.held + q.others
    if not held:
        return ""
    where = f", {q.others} of them on other gateways" if q.others else ""
    return f", {held} held by requests in flight (prompt / 4 + max_tokens × n each{where})"


# The fields engines read a choice's length cap from, in the order the cap is taken from a request: OpenAI's
# (vLLM reads max_completion_tokens first), then llama.cpp's `n_predict` (which llama-server prefers to
# max_tokens), then SGLang's `max_new_tokens`.
LENGTH_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict", "max_new_tokens")


def _asked_cap(req: dict) -> tuple[int | None, bool]:
    """The length cap a request sets for each choice, or None when it sets none (`n_predict: -1` is
    llama.cpp's "until the context is full": none), and whether it is OpenAI's field (every engine reads
    it) rather than one engine's own, which the others ignore. The parser has checked each is an integer in
    range."""
    for i, field in enumerate(LENGTH_FIELDS):
        v = req.get(field)
        if type(v) is int and v >= 0:
            return v, i < 2
    return None, False


def _over(req: dict, cap: int) -> bool:
    """Whether any length field the request sends would let a choice generate more than `cap`."""
    for field in LENGTH_FIELDS:
        v = req.get(field)
        if type(v) is int and (v > cap or v < 0):
            return True
    return False


def _capped(req: dict, cap: int, forward: bool) -> dict:
    """`req` with every length field it sends clamped to `cap`, and `max_tokens: cap` when `forward` and it
    sends neither of OpenAI's (an engine's own field binds only that engine)."""
    out = dict(req)
    for field in LENGTH_FIELDS:
        v = out.get(field)
        if type(v) is int and (v > cap or v < 0):
            out[field] = cap
    if forward and type(out.get("max_tokens")) is not int and type(out.get("max_completion_tokens")) is not int:
        out["max_tokens"] = cap
    return out


def _room_left(quotas: tuple[Quota, ...]) -> int | None:
    """The fewest tokens any token limit of `quotas` leaves (tokens per minute, the day's and the month's
    budgets; what requests in flight hold counted as used), as of the `take` just done; None when none
    has a token limit."""
    left: int | None = None
    for q in quotas:
        if not q.metered:
            continue
        if q.tokens._limit is not None:
            n = q.tokens_left  # set by this request's `take`
            left = n if left is None or n < left else left
        for b in (q.day, q.month):
            if b.limit is not None:
                n = b.limit - b.used - q.held - q.others
                left = n if left is None or n < left else left
    return left


_requests_left = attrgetter("requests_left")
_tokens_left = attrgetter("tokens_left")


class Account:
    """An accounted key as the proxy sees it: its id, tenant (None: none), metric label, and quotas (its
    tenant's, then its own when it has limits)."""

    __slots__ = ("key_id", "tenant", "label", "quotas", "request_quotas", "token_quotas", "one_quota", "metered",
                 "_allowed", "_rows")

    def __init__(self, key_id: str, tenant: str | None, quotas: tuple[Quota, ...]):
        self.key_id = key_id
        self.tenant = tenant
        self.label = tenant or NO_TENANT
        self.quotas = quotas
        # Made once per refresh (limits change only through one): the quotas the headers come from.
        self.request_quotas = tuple(q for q in quotas if q.limits.rpm is not None)
        self.token_quotas = tuple(q for q in quotas if q.limits.tpm is not None)
        rq, tq = self.request_quotas, self.token_quotas
        self.one_quota = rq[0] if len(rq) == 1 and tq == rq else None  # both headers' kinds from one quota
        self.metered = any(q.metered for q in quotas)  # a token limit applies: the reservation is clamped to it
        self._allowed: dict[str, Quota | None] = {}  # model name -> the quota refusing it (None: allowed)
        self._rows: dict[str, usage_repo.RowKey] = {}  # model name -> its usage row's key

    def row(self, model: str) -> usage_repo.RowKey:
        """The key of this key's usage row for `model`: (tenant or '', key id, model)."""
        key = self._rows.get(model)
        if key is None:
            key = self._rows[model] = (self.tenant or "", self.key_id, model)
        return key

    def refusing(self, model: Model) -> Quota | None:
        """The quota whose `models` does not allow `model`, or None (cached until the catalog changes)."""
        name = model.name
        if name in self._allowed:
            return self._allowed[name]
        out = next((q for q in self.quotas if q.limits.models is not None
                    and not model_allowed(q.limits.models, model)), None)
        self._allowed[name] = out
        return out


class Meter:
    """One accounted request on its way: the usage read from its answer, the rate-limit headers for its
    response, and whether the usage chunk it did not ask for must be dropped (`strip`)."""

    __slots__ = ("account", "row", "strip", "head", "lines", "counts", "prompt_chars", "cap", "stream", "relayed",
                 "whole", "sent", "held")

    def __init__(self, account: Account, row: usage_repo.RowKey, strip: bool, head: bytes, cap: int = 0,
                 stream: bool = False, prompt_chars: int = 0, held: int = 0):
        self.account = account
        self.row = row  # its usage row's key: (tenant or '', key id, the model the client asked for)
        self.strip = strip
        self.head = head  # the rate-limit headers as header lines (llmgw/http/response_head.py)
        self.lines = False  # the server writes `head` as it is (the proxy sets it from the scope)
        self.counts: Counts | None = None
        # What an answer without usage is charged from (`Quotas.settle`): the prompt's characters, the
        # request's max_tokens, and the events relayed of a stream (the proxy counts them).
        self.prompt_chars = prompt_chars
        self.cap = cap
        self.stream = stream
        self.relayed = 0
        self.whole = False  # an answer not streamed was read whole
        self.sent = False  # the prompt reached an engine or a guard's judge, which read it (the proxy sets it)
        self.held = held  # tokens reserved in its quotas at admission (`Quota.held`), released as it settles

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers as a header list (for a server without the `llmgw.head` extension)."""
        return head_lines(self.head)

    def body(self, data: bytes) -> None:
        """A non-streamed answer, whole."""
        self.whole = True
        found = usage_of_body(data)
        if found is not None:
            self.counts = found

    def events(self, out: bytes) -> bytes:
        """Complete events about to be relayed -> the events to relay (the usage chunk stripped)."""
        out, found = read_events(out, self.strip)
        if found is not None:
            self.counts = found
        return out


class Batch:
    """Counts written to Postgres as one, at most once: `id` (a uuid made once, kept with the batch until it
    is known written and recorded with its rows, `usage_repo.claim`), when they were counted (`at`, the
    database's clock: its minute and its budget periods are theirs), and rows as `Quotas.pending`.
    `sealed`: a write of it may have committed, so nothing more may be added under its id."""

    __slots__ = ("id", "at", "minute", "rows", "sealed")

    def __init__(self, at: float, rows: dict[usage_repo.RowKey, list[int]]):
        self.id = str(uuid.uuid4())
        self.at = at
        self.minute = at // WINDOW_S * WINDOW_S
        self.rows = rows
        self.sealed = False


_by_minute = attrgetter("minute")


class Quotas:
    """Every accounted key's quotas on this gateway, their admission, and their sync with Postgres.
    `sync_s`: seconds between syncs; `day_s`: a shorter budget day (tests only)."""

    def __init__(self, engine: AsyncEngine, metrics: GatewayMetrics, sync_s: float = 1.0, day_s: float | None = None):
        self.engine = engine
        self.metrics = metrics
        self.sync_s = sync_s
        self.day_s = day_s
        self.scopes: dict[tuple[str, str], Quota] = {}
        self.accounts: dict[str, Account] = {}
        self.pending: dict[usage_repo.RowKey, list[int]] = {}  # counted since the last sync: [requests, prompt, completion]
        # Counted but not known written yet (Postgres away, or a COMMIT unanswered), in batches by the minute
        # each was counted in.
        self.backlog: list[Batch] = []
        self.offset = 0.0  # database clock - this host's clock, as of the last sync
        self.clock = time.time  # this host's clock (tests set their own)
        # This gateway's row of holds (`usage_repo.Holds`): its id, how long the others count it after a sync
        # (a dead gateway's holds stop counting then), and whether the row last written held anything.
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.holds_fresh_s = HOLDS_FRESH_SYNCS * sync_s
        self._published = False

    # ---- what the keys and tenants say (KeyRing.refresh) ----------------------------------------
    def rebuild(self, tenants: dict[str, dict], keys: list[ActiveKey]) -> dict[str, Account]:
        """Accounts for the active keys that belong to a tenant or have limits, keeping the counts of every
        tenant and key already known. Returns key id -> Account."""
        scopes: dict[tuple[str, str], Quota] = {}

        def quota(scope: str, name: str, stored: dict) -> Quota:
            q = scopes.get((scope, name)) or self.scopes.get((scope, name)) or Quota(scope, name, self.day_s)
            try:
                q.set(Limits.model_validate(stored))
            except ValidationError as exc:  # written around the admin API: said loudly, and not enforced
                log.error("the stored limits of %s are not valid and are not enforced: %s", q.who, exc)
                q.set(Limits())
            scopes[(scope, name)] = q
            return q

        accounts: dict[str, Account] = {}
        for k in keys:
            qs = []
            if k.tenant is not None:
                qs.append(quota("tenant", k.tenant, tenants.get(k.tenant, {})))
            if k.limits:
                qs.append(quota("key", k.id, k.limits))
            if qs:
                accounts[k.id] = Account(k.id, k.tenant, tuple(qs))
        self.scopes, self.accounts = scopes, accounts
        return accounts

    def catalog_changed(self, catalog=None) -> None:
        """Aliases and names may have changed: model permissions are judged again."""
        for a in self.accounts.values():
            a._allowed.clear()

    def now(self) -> float:
        """The database clock, as estimated here."""
        return self.clock() + self.offset

    # ---- one request -------------------------------------------------------------------------------
    def admit(self, account: Account, model: Model, req: dict, body: bytes,
              prompt_chars: int = 0, output: OutputBound | None = None,
              usage_as: str | None = None) -> tuple[Meter, dict, bytes]:
        """Admit one request of `account` for `model` (the catalog model the client named), or raise the
        403/429 `APIError`. Returns its meter and the request to send (asking for usage when it streams).
        Every answer of a key with limits goes through here: a few compares and additions per quota.

        What it may use is held in its quotas until it settles, as OpenAI counts a request against a
        limit: a token for every 4 characters of prompt, plus its length cap for each choice (`n`, or
        `best_of` where larger). The cap is the one it sets (`_asked_cap`), else `output` (the model's
        `OutputBound`, from the route table; computed here when not given); where a token limit applies it
        is cut to what the tightest one leaves each choice. Every length field it sends (`max_tokens`,
        `max_completion_tokens`, llama.cpp's `n_predict`, SGLang's `max_new_tokens`) is clamped to the cap,
        and the cap is sent as `max_tokens` when it was not the request's own and the engine would not stop
        there by itself (issue 37): the engine cannot generate past what was reserved. A request whose own
        caps are within what is left is sent as it came. `usage_as`: the name its usage is recorded under
        when not the model's (a LoRA adapter's, served by its base `model`: issue 40)."""
        refusing = account._allowed.get(model.name, _UNSEEN)
        if refusing is not None:
            if refusing is _UNSEEN:
                refusing = account.refusing(model)
            if refusing is not None:
                self.metrics.refused(account.label, "models")
                raise errors.model_not_allowed(model.name, refusing.who, refusing.limits.models or [])
        strip = False
        stream = req.get("stream") is True
        if stream:
            req, body, strip = ask_usage(req, body)
        now = self.clock() + self.offset
        quotas = account.quotas
        if not quotas[0].take(now):
            raise self._refusal(account, quotas[0], now)
        for i in range(1, len(quotas)):
            if not quotas[i].take(now):
                for q in quotas[:i]:
                    q.untake()
                raise self._refusal(account, quotas[i], now)
        key = account.row(usage_as or model.name)
        row = self.pending.get(key)
        if row is None:
            row = self.pending[key] = [0, 0, 0]
        row[0] += 1
        prompt = -(-prompt_chars // CHARS_PER_TOKEN)
        # Choices generated: `n`, or `best_of` where larger (the parser bounds both to 1..128).
        k = req.get("n")
        if type(k) is not int:
            k = 1
        best = req.get("best_of")
        if type(best) is int and best > k:
            k = best
        cap, common = _asked_cap(req)
        asked = cap
        # A cap only one engine reads (n_predict, max_new_tokens) is also sent as max_tokens, or the others
        # would generate on past what was reserved.
        forward = cap is not None and not common
        if cap is None:  # none set: what the engine may generate (catalog/context.py)
            bound = output if output is not None else output_bound(model, prompt_bound(model))
            cap, forward = bound.tokens, bound.forward
        left = _room_left(quotas) if account.metered else None
        if left is not None:
            per = (left - prompt) // k  # what the tightest token limit leaves each choice
            if per < 1:
                per = 1  # admitted with some room: one token a choice (the last may pass it, as before)
            if per < cap:
                cap, forward = per, True
        if forward or _over(req, cap):
            req = _capped(req, cap, forward)
            body = json.dumps(req).encode()
        held = prompt + cap * k
        for q in quotas:
            q.held += held
        # A whole answer without usage is charged the cap its engine was told (none told: its prompt only).
        told = cap * k if asked is not None or forward else 0
        return Meter(account, key, strip, self._head(account, now), told, stream, prompt_chars, held), req, body

    def refusal(self, account: Account) -> errors.APIError | None:
        """The 429 `admit` would give `account` now for its requests per minute, tokens per minute or a spent
        budget, or None; nothing is counted. The gateway asks this when a request's headers arrive, before
        its body is read, so that a key out of requests or budget cannot hold connections by trickling
        bodies in (issue 36). What needs the body (the model's permission, the reservation) waits for `admit`."""
        now = self.clock() + self.offset
        for q in account.quotas:
            if not q.fits(now):
                return self._refusal(account, q, now)
        return None

    def _refusal(self, account: Account, q: Quota, now: float) -> errors.APIError:
        """The 429 for the first of `q`'s limits that leaves no room (counted in the metrics)."""
        headers = self._current_headers(account, now)
        w = q.requests
        if not w.room(now, 1):
            self.metrics.refused(account.label, "rpm")
            wait = w.wait_s(now, 1)
            return errors.rate_limited(
                f"Rate limit reached for {q.who} on requests per minute (RPM): limit {w.limit}, used "
                f"{w.used(now):.0f}, requested 1. Please try again in {duration_text(wait)}.", wait, headers)
        w = q.tokens
        held = q.held + q.others
        if not w.room(now, 0) or (w.limit is not None and w.used(now) + held >= w.limit):
            self.metrics.refused(account.label, "tpm")
            wait = w.wait_s(now, 0) or 1.0  # 0: what is held by requests in flight fills it; they end soon
            return errors.rate_limited(
                f"Rate limit reached for {q.who} on tokens per minute (TPM): limit {w.limit}, used "
                f"{w.used(now):.0f}{_held_text(q)}. Please try again in {duration_text(wait)}.", wait, headers)
        b, period = (q.day, "day") if not q.day.room(now, held) else (q.month, "month")
        if b.room(now):  # not spent: what requests in flight may use fills it, until they are counted
            self.metrics.refused(account.label, f"tokens_per_{period}")
            return errors.rate_limited(
                f"Rate limit reached for {q.who} on its token budget for the {period}: {b.used_now(now)} of "
                f"{b.limit} tokens used{_held_text(q)}. Please try again in 1s.", 1.0, headers)
        self.metrics.refused(account.label, f"tokens_per_{period}")
        wait = b.wait_s(now)
        renews = datetime.fromtimestamp(b.end, timezone.utc).isoformat().replace("+00:00", "Z")
        return errors.quota_spent(
            f"{q.who} has used its token budget for the {period}: {b.used_now(now)} of {b.limit} tokens; it renews "
            f"at {renews} (in {duration_text(wait)})", wait, headers)

    @staticmethod
    def _current_headers(account: Account, now: float) -> dict[str, str]:
        """The `x-ratelimit-*` headers as of `now` (for a refusal, where nothing was taken)."""
        out: dict[str, str] = {}
        for kind, quotas in (("requests", account.request_quotas), ("tokens", account.token_quotas)):
            windows = [q.requests if kind == "requests" else q.tokens for q in quotas]
            if windows:
                left, reset, w = min((w.report(now) + (w,) for w in windows), key=lambda x: x[0])
                out[f"x-ratelimit-limit-{kind}"] = str(w.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(left)
                out[f"x-ratelimit-reset-{kind}"] = duration_text(reset)
        return out

    @staticmethod
    def _head(account: Account, now: float) -> bytes:
        """OpenAI's `x-ratelimit-*` headers, from the tightest of the account's windows with a limit, as
        header lines (llmgw/http/response_head.py: names of ours, values digits and durations)."""
        q = account.one_quota
        if q is not None:  # one quota with both limits (a tenant's rpm and tpm): one format
            return _BOTH_LINES % (q.requests.limit_text, q.requests_left, reset_header(q.requests_reset),
                                  q.tokens.limit_text, q.tokens_left, reset_header(q.tokens_reset))
        out = b""
        quotas = account.request_quotas
        if quotas:
            q = quotas[0] if len(quotas) == 1 else min(quotas, key=_requests_left)
            out = _REQUEST_LINES % (q.requests.limit_text, q.requests_left, reset_header(q.requests_reset))
        quotas = account.token_quotas
        if quotas:
            q = quotas[0] if len(quotas) == 1 else min(quotas, key=_tokens_left)
            out += _TOKEN_LINES % (q.tokens.limit_text, q.tokens_left, reset_header(q.tokens_reset))
        return out

    def settle(self, meter: Meter) -> None:
        """The request ended: count the tokens its answer reported, once. An answer that reported none (the
        client went away before the stream's usage chunk, or the engine sent none) is charged an estimate,
        so that leaving early is no way around a budget: a token for each 4 characters of prompt, and a
        token for each event relayed of a stream, or the request's max_tokens for an answer not streamed.
        A request the engine never answered (refused, failed, held through a load that failed) is charged
        nothing; one whose prompt reached an engine or a guard's judge, which read it, is charged at least
        that. What it held in its quotas since admission is released first, whatever happened."""
        quotas = meter.account.quotas
        if meter.held:
            for q in quotas:
                q.held -= meter.held
            meter.held = 0
        if meter.counts is None:
            self.metrics.usage_missing.labels(meter.row[2]).inc()
            if not (meter.relayed or meter.whole or meter.sent):
                return
            prompt = -(-meter.prompt_chars // CHARS_PER_TOKEN)
            completion = meter.relayed if meter.stream else meter.cap if meter.whole else 0
            if not prompt and not completion:
                return
        else:
            prompt, completion = meter.counts
        now = self.clock() + self.offset
        for q in quotas:
            q.spend(prompt + completion, now)
        row = self.pending.get(meter.row)
        if row is None:
            row = self.pending[meter.row] = [0, 0, 0]
        row[1] += prompt
        row[2] += completion

    # ---- the sync ---------------------------------------------------------------------------------
    async def sync(self) -> None:
        """Add this gateway's counts since the last sync to Postgres and read back the fleet's.

        The counts go as `Batch`es, each written at most once (its id is recorded with its rows,
        `usage_repo.claim`). A failure before the COMMIT was sent wrote nothing: the counts join the
        backlog's batch of their minute. A failure at the COMMIT (the connection lost as it was sent or
        answered) may have written them: those batches are kept whole, with their ids, and a retry of one
        that was written adds nothing."""
        quotas = list(self.scopes.values())
        if not quotas and not self.pending and not self.backlog:
            return  # no accounted key: nothing to write, nothing to read
        rows, self.pending = self.pending, {}
        taken = [(q, q.taken()) for q in quotas]
        # What this gateway's requests in flight hold now, written in the same transaction as the counts
        # taken above: the others never see a request's tokens both held and counted, nor neither.
        held = {scope: q.held for scope, q in self.scopes.items() if q.held > 0 and q.metered}
        holds = usage_repo.Holds(self.gateway_id, held, self.holds_fresh_s, write=bool(held) or self._published)
        fresh: Batch | None = None
        committing = False
        try:
            async with self.engine.begin() as conn:
                t0 = self.clock()  # (once connected: a slow reconnect is not the clocks' difference)
                now = await usage_repo.db_now(conn)
                minute = now // WINDOW_S * WINDOW_S
                day = period_bounds("day", now, self.day_s)
                month = period_bounds("month", now)
                periods = {"day": day[0], "month": month[0]}
                if rows:
                    fresh = Batch(now, rows)
                todo = [*self.backlog, fresh] if fresh is not None else self.backlog
                new = await usage_repo.claim(conn, [b.id for b in todo])
                for b in sorted(todo, key=_by_minute):  # each minute's counts to it and to its own day and month
                    if b.id in new:
                        at = b.at
                        await usage_repo.add(conn, b.minute, {"day": period_bounds("day", at, self.day_s)[0],
                                                              "month": period_bounds("month", at)[0]}, b.rows)
                minutes, spent, others = await usage_repo.totals(conn, minute - WINDOW_S, periods, holds)
                committing = True  # what fails from here on may have been written
        except BaseException:
            self._published = True  # the row may hold what was sent: written again next time
            for q, t in taken:
                q.restore(t)
            if fresh is None and rows:
                # Kept for the next sync under the minute they were counted in, as this gateway reckons the
                # database clock (its last offset): not under whichever minute Postgres comes back in.
                fresh = Batch(self.now(), rows)
            self._keep(fresh, committing)
            raise
        written, self.backlog = self.backlog, []
        self.offset = now - t0
        self._published = bool(held)
        self._apply(minute, day, month, minutes, spent, others)
        for b in (*written, fresh) if fresh is not None else written:  # counted once, when known written
            for (tenant, _, model), (_, prompt, completion) in b.rows.items():
                if prompt or completion:
                    self.metrics.count_tokens(tenant or NO_TENANT, model, prompt, completion)

    def _keep(self, fresh: Batch | None, committing: bool) -> None:
        """A sync failed: keep its counts for the next. When its COMMIT may have reached Postgres, every
        batch it carried is sealed (kept whole with its id: it may be written); else `fresh` is merged into
        the unsealed batch of its minute (never written, so its id may cover more)."""
        if committing:
            for b in self.backlog:
                b.sealed = True
            if fresh is not None:
                fresh.sealed = True
                self.backlog.append(fresh)
            return
        if fresh is None:
            return
        into = next((b for b in self.backlog if not b.sealed and b.minute == fresh.minute), None)
        if into is None:
            self.backlog.append(fresh)
            return
        for k, (r, p, c) in fresh.rows.items():
            row = into.rows.get(k)
            if row is None:
                into.rows[k] = [r, p, c]
            else:
                row[0] += r
                row[1] += p
                row[2] += c

    def _apply(self, minute: float, day: tuple[float, float], month: tuple[float, float],
               minutes: list[usage_repo.MinuteTotal], spent: list[usage_repo.PeriodTotal],
               others: list[usage_repo.HeldTotal] = ()) -> None:
        # per tenant and per key: [requests prev minute, requests this minute, tokens prev, tokens this, day, month]
        sums: dict[tuple[str, str], list[int]] = {}

        def add(tenant: str, key_id: str, i: int, n: int) -> None:
            for scope in ((("tenant", tenant),) if tenant else ()) + (("key", key_id),):
                sums.setdefault(scope, [0] * 6)[i] += n

        for m in minutes:
            now_minute = m.minute >= minute
            add(m.tenant, m.key_id, 1 if now_minute else 0, m.requests)
            add(m.tenant, m.key_id, 3 if now_minute else 2, m.tokens)
        for s in spent:
            add(s.tenant, s.key_id, 4 if s.period == "day" else 5, s.tokens)
        elsewhere = {(h.scope, h.name): h.tokens for h in others}
        zero = [0] * 6
        for scope, q in self.scopes.items():
            v = sums.get(scope, zero)
            q.requests.synced(minute, v[0], v[1])
            q.tokens.synced(minute, v[2], v[3])
            q.day.synced(day[0], day[1], v[4])
            q.month.synced(month[0], month[1], v[5])
            q.others = elsewhere.get(scope, 0)

    async def sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_s)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - kept for the next sync; logged and counted
                log.exception("syncing token usage with Postgres failed; the counts are kept for the next try")
                self.metrics.usage_sync_errors.inc()

    async def close(self) -> None:
        """On a clean stop: what was counted since the last sync is written, and this gateway's row of holds
        goes (its requests have ended)."""
        try:
            await self.sync()
        except Exception:  # noqa: BLE001 - the process is going; say what is lost
            log.warning("could not write the token usage not yet written (%d rows) on the way out",
                        len(self.pending) + sum(len(b.rows) for b in self.backlog))
        if not self._published and not self.scopes:
            return  # never wrote a row (no accounted key)
        try:
            async with self.engine.begin() as conn:
                await usage_repo.forget_holds(conn, self.gateway_id)
        except Exception:  # noqa: BLE001 - it expires by itself
            log.warning("could not remove this gateway's row of holds on the way out; it expires in %.0f s",
                        self.holds_fresh_s)
