"""Choosing an endpoint: least outstanding requests among those whose circuit breaker lets them through.

Breaker per endpoint (seeds 001: the breaker took a dead endpoint out and retries covered it):
- closed: requests flow; each failure (no connection, a 5xx, a timeout, an answer broken off) counts,
  each success resets the count;
- open: after `failures` consecutive failures the endpoint gets no request for `open_s` seconds;
- half-open: then exactly one trial request goes through; its success closes the breaker, its failure
  opens it again for `open_s`.
Ties in outstanding requests rotate, so one-at-a-time traffic still spreads over the replicas.

Prefix-aware (a model with `balancing: prefix`, issue 37): a request with a prefix key (gateway/prefix.py)
goes to the key's **home**, the replica this gateway sent that prefix to before (so its engine most likely
holds it cached), while the home is within the **load bound**: `LOAD_FACTOR` × the mean of this gateway's
requests in flight to the usable replicas (this one included), rounded up, as in consistent hashing with
bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018). Some replica is always within it (the least loaded
is at most the mean).
- A home over the bound: this request alone goes to the least loaded replica (the home is kept; a burst
  does not move a prefix's cache).
- A new key, or one whose home left (or its breaker is open): homed on the replica that is home to the
  fewest keys, among those within the bound; ties go to the key's rendezvous ranking (highest random
  weight: a hash of the key and the replica id, not Python's per-process hash), so gateways that see the
  same keys arrive home them alike. Hashing alone (rendezvous, or a ring) gives few hot prefixes uneven
  homes: 16 system prompts on 4 replicas fell 6, 6, 4, 0, and one replica held none of them.
- Homes are remembered per gateway, at most `MAX_HOMES` keys, the least recently used forgotten first; with
  several gateways a prefix may therefore be cached on up to one replica per gateway.

Each pick leaves `last`: why it chose what it chose (`Choice`), for the request's trace.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from llmgw.gateway.routes import Endpoint

LOAD_FACTOR = 1.25  # a key's home takes at most this times the mean load before a request goes elsewhere
MAX_HOMES = 65536  # prefix keys whose home a gateway remembers
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a 64-bit key and a replica's seed into a well-spread score."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@dataclass(slots=True)
class Choice:
    """Why a pick chose its endpoint. `policy`: `least_outstanding` or `prefix`; for `prefix`, `how`: `home`
    (the key's home), `overflow` (its home, `home`, was over the bound), `new` (homed now) or `rehomed`
    (its home, `home`, is gone or unusable), and `bound` the load bound."""

    policy: str
    replica: str
    outstanding: int
    key: int | None = None
    how: str = ""
    bound: int = 0
    home: str = ""
    homes: int = 0

    def reason(self) -> str:
        if self.key is None:
            return f"least outstanding: {self.replica} with {self.outstanding} in flight"
        k = f"prefix {self.key:016x}"
        if self.how == "home":
            return f"{k}: its home {self.replica} ({self.outstanding} in flight, bound {self.bound})"
        if self.how == "overflow":
            return (f"{k}: its home {self.home} is over the bound of {self.bound}; {self.replica}, the least "
                    f"loaded ({self.outstanding} in flight)")
        was = f"its home {self.home} is gone or unusable; " if self.how == "rehomed" else "a new prefix; "
        return (f"{k}: {was}homed on {self.replica}, home to the fewest prefixes ({self.homes}), "
                f"{self.outstanding} in flight, bound {self.bound}")


class Balancer:
    """Picks endpoints and keeps their breakers. `failures` and `open_s` come from Settings."""

    def __init__(self, failures: int = 5, open_s: float = 10.0):
        self.failures = max(1, failures)
        self.open_s = open_s
        self._turn = 0
        self.last: Choice | None = None
        self.homes: OrderedDict[int, str] = OrderedDict()  # prefix key -> replica id, least recent first
        self.held: dict[str, int] = {}  # replica id -> keys homed on it

    def usable(self, ep: Endpoint, now: float) -> bool:
        """Closed, or half-open with no trial request in flight."""
        if ep.failures < self.failures:
            return True
        return ep.open_until <= now and not ep.trial

    def pick(self, endpoints: list[Endpoint], tried: set[str], now: float, key: int | None = None) -> Endpoint | None:
        """The usable endpoint with the fewest outstanding requests, not in `tried` (replica ids); with a
        prefix `key`, the one its ranking prefers within the load bound (`_by_prefix`)."""
        if key is not None and len(endpoints) > 1:
            return self._by_prefix(endpoints, tried, now, key)
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
        self.last = Choice("least_outstanding", best.replica_id, best.outstanding) if best is not None else None
        return best

    def _by_prefix(self, endpoints: list[Endpoint], tried: set[str], now: float, key: int) -> Endpoint | None:
        usable = [ep for ep in endpoints if ep.replica_id not in tried and self.usable(ep, now)]
        if not usable:
            self.last = None
            return None
        load = 1  # this request
        for ep in usable:
            load += ep.outstanding
        bound = math.ceil(LOAD_FACTOR * load / len(usable))
        home_id = self.homes.get(key)
        home = next((ep for ep in usable if ep.replica_id == home_id), None) if home_id is not None else None
        if home is not None and home.outstanding < bound:
            self.homes.move_to_end(key)
            ep, choice = home, Choice("prefix", home.replica_id, home.outstanding, key, "home", bound)
        elif home is not None:  # busy: this request elsewhere, the prefix stays home
            ep = min(usable, key=lambda e: e.outstanding)
            choice = Choice("prefix", ep.replica_id, ep.outstanding, key, "overflow", bound, home.replica_id)
        else:
            held = self.held
            ep = min((e for e in usable if e.outstanding < bound),
                     key=lambda e: (held.get(e.replica_id, 0), -_mix(key ^ e.seed)))
            self._home(key, ep.replica_id)
            choice = Choice("prefix", ep.replica_id, ep.outstanding, key, "rehomed" if home_id else "new", bound,
                            home_id or "", held[ep.replica_id] - 1)
        if ep.failures >= self.failures:
            ep.trial = True
        self.last = choice
        return ep

    def _home(self, key: int, replica_id: str) -> None:
        old = self.homes.pop(key, None)
        if old is not None:
            self._unhold(old)
        self.homes[key] = replica_id
        self.held[replica_id] = self.held.get(replica_id, 0) + 1
        if len(self.homes) > MAX_HOMES:
            _, gone = self.homes.popitem(last=False)
            self._unhold(gone)

    def _unhold(self, replica_id: str) -> None:
        n = self.held.get(replica_id, 0) - 1
        if n > 0:
            self.held[replica_id] = n
        else:
            self.held.pop(replica_id, None)

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
