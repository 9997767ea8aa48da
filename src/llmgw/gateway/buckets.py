"""The arithmetic of fleet-wide limits kept in memory (issue 15): minute windows and period budgets.

Every gateway keeps, for each tenant and each key with limits, a `Window` of requests and one of tokens,
and a `Budget` of tokens for the day and one for the month (gateway/quotas.py). It adds what it admits and
counts at once, and every second it writes its counts to Postgres and reads the fleet's back: `synced()`
replaces the counts with the fleet's and keeps on top what this gateway counted while the query ran
(`unsynced`). So a gateway judges by the fleet as of the last second plus its own traffic since, and N
gateways together pass a limit by at most what the others admitted within that second.

A window is a sliding-window counter over the two fixed minutes the usage rows are kept in: the previous
minute's count, weighted by the share of it still inside the last 60 s, plus the current minute's,

    used(t) = prev · (1 − e/60) + cur        (e: seconds into the current minute)

which needs no more than the per-minute rows every gateway writes, never admits a burst of twice the limit
across a minute boundary as fixed windows do, and refills smoothly as the previous minute fades. A request
is admitted while `used + 1 ≤ limit` (requests) or `used + held < limit` (tokens: they are known only once
the answer is, so a request is admitted while the bucket is not exhausted, and what it uses is counted
after; `held` is what the requests in flight may still use, reserved at admission: on this gateway now,
on the others as of the last sync; so that many requests admitted at once cannot all pass a budget before
the first of them is counted).

Budgets count tokens over a UTC day or month (`period_bounds`, from the database clock); a spent one is
refused until the period turns. Times are seconds since the epoch on the database's clock.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Callable

WINDOW_S = 60.0
DAY_S = 86400.0

Bounds = Callable[[float], tuple[float, float]]


def period_bounds(kind: str, now: float, day_s: float | None = None) -> tuple[float, float]:
    """(start, end) of the budget period `kind` ('day' or 'month', UTC) holding `now` (epoch seconds).
    `day_s` shortens the day (`LLMGW_TEST_BUDGET_DAY_S`, tests only); the month is always a calendar one."""
    if kind == "day":
        length = day_s or DAY_S  # POSIX time has no leap seconds: epoch days are UTC days
        start = now // length * length
        return start, start + length
    if kind != "month":
        raise ValueError(f"no budget period {kind!r}")
    d = datetime.fromtimestamp(now, timezone.utc)
    start = datetime(d.year, d.month, 1, tzinfo=timezone.utc)
    end = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start.timestamp(), end.timestamp()


def duration_text(seconds: float) -> str:
    """A duration as OpenAI writes it in `x-ratelimit-reset-*` (Go's style): `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    out = f"{h}h" if h else ""
    if h or m:
        out += f"{m}m"
    return out + f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"


_RESET_TEXT: dict[int, bytes] = {}


def reset_header(seconds: float) -> bytes:
    """`duration_text` for the `x-ratelimit-reset-*` headers sent with every answer of a key with limits:
    whole seconds from 1 s up (rounded up, so a client that waits that long finds the window reset), kept
    once made (a window resets within 120 s: a few hundred strings at most)."""
    if seconds < 1:
        return b"%dms" % max(0, round(seconds * 1000))
    n = math.ceil(seconds)
    text = _RESET_TEXT.get(n)
    if text is None:
        text = duration_text(n).encode()
        if len(_RESET_TEXT) < 4096:
            _RESET_TEXT[n] = text
    return text


class Window:
    """Requests or tokens in the last minute, fleet-wide. `limit` None: counted, never refused."""

    __slots__ = ("_limit", "limit_text", "start", "prev", "cur", "unsynced")

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.start = 0.0  # the current minute's start; rolled forward on first use
        self.prev = 0
        self.cur = 0
        self.unsynced = 0  # counted here since the last sync took its snapshot

    @property
    def limit(self) -> int | None:
        return self._limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self._limit = value
        self.limit_text = b"" if value is None else b"%d" % value  # for the headers of every answer

    def _roll(self, now: float) -> None:
        if now >= self.start + WINDOW_S:
            steps = (now - self.start) // WINDOW_S
            self.prev = self.cur if steps == 1 else 0
            self.cur = 0
            self.start += steps * WINDOW_S

    def used(self, now: float) -> float:
        self._roll(now)
        return self.prev * (1.0 - (now - self.start) / WINDOW_S) + self.cur

    def add(self, n: int, now: float) -> None:
        self._roll(now)
        self.cur += n
        self.unsynced += n

    def room(self, now: float, cost: int) -> bool:
        """Whether something of `cost` fits now: `used + cost ≤ limit`, or `used < limit` for cost 0."""
        if self._limit is None:
            return True
        used = self.used(now)
        return used + cost <= self._limit if cost else used < self._limit

    def remaining(self, now: float) -> int:
        return 0 if self._limit is None else max(0, math.floor(self._limit - self.used(now)))

    def wait_s(self, now: float, cost: int) -> float:
        """Seconds until `room(cost)`, if nothing more is counted meanwhile (0 when there is room now)."""
        if self.room(now, cost):
            return 0.0
        assert self._limit is not None
        need = self._limit - cost
        e = now - self.start
        if self.prev and (self.cur < need if cost == 0 else self.cur <= need):
            # the previous minute's share fades: room once prev · (1 − e'/60) + cur ≤ need
            return max(0.0, WINDOW_S * (1.0 - (need - self.cur) / self.prev) - e)
        # this minute alone is over: room in the next, once cur · (1 − e''/60) ≤ need
        return (WINDOW_S - e) + WINDOW_S * (1.0 - need / self.cur)

    def report(self, now: float) -> tuple[int, float]:
        """(`remaining`, `reset_s`) in one pass, for the headers of every answer."""
        if now >= self.start + WINDOW_S:
            self._roll(now)
        e = now - self.start
        left = (self._limit or 0) - (self.prev * (1.0 - e / WINDOW_S) + self.cur)
        reset = 2 * WINDOW_S - e if self.cur else WINDOW_S - e if self.prev else 0.0
        return (int(left) if left > 0 else 0), reset

    def reset_s(self, now: float) -> float:
        """Seconds until nothing is counted any more (what OpenAI calls the reset), if nothing more comes."""
        self._roll(now)
        if self.cur:
            return 2 * WINDOW_S - (now - self.start)
        if self.prev:
            return WINDOW_S - (now - self.start)
        return 0.0

    # ---- the sync (gateway/quotas.py) ----------------------------------------------------------
    def taken(self) -> int:
        """What this gateway counted since the last sync, now being written; `restore` it if that fails."""
        n, self.unsynced = self.unsynced, 0
        return n

    def restore(self, n: int) -> None:
        self.unsynced += n

    def synced(self, start: float, prev: int, cur: int) -> None:
        """The fleet's counts for the minute starting at `start` and the one before, this gateway's written
        ones included; what it counted since the snapshot is kept on top."""
        self.start, self.prev, self.cur = start, prev, cur + self.unsynced


class Budget:
    """Tokens used in the current day or month, fleet-wide. `limit` None: counted, never refused."""

    __slots__ = ("kind", "bounds", "limit", "start", "end", "used", "unsynced")

    def __init__(self, kind: str, bounds: Bounds, limit: int | None = None):
        self.kind = kind
        self.bounds = bounds  # now -> (start, end) of the period holding it
        self.limit = limit
        self.start = self.end = 0.0
        self.used = 0
        self.unsynced = 0

    def _roll(self, now: float) -> None:
        if now >= self.end or now < self.start:
            self.start, self.end = self.bounds(now)
            self.used = 0

    def add(self, n: int, now: float) -> None:
        self._roll(now)
        self.used += n
        self.unsynced += n

    def room(self, now: float, held: int = 0) -> bool:
        """Not spent yet, counting `held` (what requests in flight may use): a request is admitted while any
        of the budget is left."""
        if self.limit is None:
            return True
        if not self.start <= now < self.end:  # (the common case, inside the period, without a call)
            self._roll(now)
        return self.used + held < self.limit

    def used_now(self, now: float) -> int:
        self._roll(now)
        return self.used

    def wait_s(self, now: float) -> float:
        """Seconds until the period turns."""
        self._roll(now)
        return self.end - now

    def taken(self) -> int:
        n, self.unsynced = self.unsynced, 0
        return n

    def restore(self, n: int) -> None:
        self.unsynced += n

    def synced(self, start: float, end: float, used: int) -> None:
        self.start, self.end, self.used = start, end, used + self.unsynced
