"""Choosing an endpoint: least outstanding requests among those whose circuit breaker lets them through.

Breaker per endpoint (seeds 001: the breaker took a dead endpoint out and retries covered it):
- closed: requests flow; each failure (no connection, a 5xx, a timeout, an answer broken off) counts,
  each success resets the count;
- open: after `failures` consecutive failures the endpoint gets no request for `open_s` seconds;
- half-open: then exactly one trial request goes through; its success closes the breaker, its failure
  opens it again for `open_s`.
Ties in outstanding requests rotate, so one-at-a-time traffic still spreads over the replicas.
"""

from __future__ import annotations

from llmgw.gateway.routes import Endpoint


class Balancer:
    """Picks endpoints and keeps their breakers. `failures` and `open_s` come from Settings."""

    def __init__(self, failures: int = 5, open_s: float = 10.0):
        self.failures = max(1, failures)
        self.open_s = open_s
        self._turn = 0

    def usable(self, ep: Endpoint, now: float) -> bool:
        """Closed, or half-open with no trial request in flight."""
        if ep.failures < self.failures:
            return True
        return ep.open_until <= now and not ep.trial

    def pick(self, endpoints: list[Endpoint], tried: set[str], now: float) -> Endpoint | None:
        """The usable endpoint with the fewest outstanding requests, not in `tried` (replica ids)."""
        best: Endpoint | None = None
        n = len(endpoints)
        self._turn += 1
        for i in range(n):
            ep = endpoints[(i + self._turn) % n]
            if ep.replica_id in tried or not self.usable(ep, now):
                continue
            if best is None or ep.outstanding < best.outstanding:
                best = ep
        if best is not None and best.failures >= self.failures:
            best.trial = True  # half-open: this request decides
        return best

    def reopens_in(self, endpoints: list[Endpoint], now: float) -> float | None:
        """Seconds until some endpoint's breaker lets a trial through, or None if none is open."""
        waits = [ep.open_until - now for ep in endpoints if ep.failures >= self.failures]
        return max(0.0, min(waits)) if waits else None

    def succeeded(self, ep: Endpoint) -> None:
        ep.failures = 0
        ep.trial = False

    def failed(self, ep: Endpoint, now: float) -> None:
        ep.failures += 1
        ep.trial = False
        if ep.failures >= self.failures:
            ep.open_until = now + self.open_s
