"""Who gets a saturated model's next slot: weighted fair queuing by tokens inside priority bands (issue 37).

Only requests that wait come here: while a model's gate (gateway/admission.py) has a free slot and nobody
waits, a request takes the slot and this module is never touched.

**Flows.** A waiting request queues in its flow: its tenant; a key of no tenant with limits of its own:
that key; every other request (a key that is not accounted, or none): one shared flow. Each flow is
served in arrival order; between flows, a freed slot goes by **start-time fair queuing** (SFQ, Goyal,
Vin and Cheng 1996) over tokens:

- a request's cost is its tokens: the prompt's estimate (a token per 4 characters) plus what it may
  generate, as its tenant's limits hold it (quotas.py `Meter.held`: its length cap, or the model's output
  bound, times its choices) or, for a request not accounted, the same figure worked out here;
- on arrival its start tag is `S = max(V, F)` and its flow's finish tag becomes `F = S + cost / weight`,
  where `V` (the band's virtual time) is the start tag of the request that last got a slot in its band;
- a freed slot goes to the waiting request with the smallest start tag (ties: arrival order).

So while flows are backlogged they get slots in proportion to their weights, counted in tokens (a flow of
long requests gets fewer of them); a flow that had nothing waiting starts at `V`, next in line, never
behind another flow's backlog. When a band has nobody waiting its memory (`V`, the flows' tags) is reset.

**Bands.** `interactive` is served before `batch`. Starvation: while both bands have requests waiting,
every `BATCH_EVERY`-th slot handed out goes to `batch`, so a batch flow gets at least 1/`BATCH_EVERY` of
the slots under any interactive backlog (and every wait is still bounded by the model's `queue_timeout_s`).

**Headroom** (the model's `limits.headroom`, 0 by default): what fair queuing cannot do is take a slot
from a request in flight, so a light tenant's request still waits for the next slot to free. With headroom
H, an interactive request whose flow has nothing waiting takes one of H slots beyond `max_concurrency` at
once, while others wait; a slot freed while more than `max_concurrency` are in flight goes back to the
headroom rather than to a waiter. A heavy tenant with a backlog never uses it; its flow is charged the
request's cost all the same.

**The queue bound** stays the model's `max_queue`, over all flows. When it is full a newcomer is not
refused if a flow holds more than its share of the queue: the newest request of the flow with the most
waiting per unit of weight (in the lowest band waiting) is refused instead (429, as a full queue's
newcomer would be), when that flow is in a lower band than the newcomer's, or in the same band with more
waiting per weight than the newcomer's flow would have with it. A heavy tenant's backlog thus never
shuts a light one out of the queue.

**Weights and bands** come from the tenant's and the key's limits (schemas/tenants.py): a key never gets
more than its tenant, so the weight is the smaller of the two (null counts as 1) and the band is `batch`
when either says so.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from itertools import count
from typing import TYPE_CHECKING

from llmgw.gateway.quotas import CHARS_PER_TOKEN, LENGTH_FIELDS

if TYPE_CHECKING:
    from llmgw.gateway.quotas import Account
    from llmgw.catalog.context import OutputBound

INTERACTIVE, BATCH = 0, 1
BATCH_EVERY = 10  # while both bands wait, one slot in this many goes to batch
SHARED_FLOW = ("-",)  # every request of a key that is not accounted, or of no key
DEFAULT_WEIGHT = 1.0


class Share:
    """Which flow a waiting request joins and how much it counts: `flow` (a hashable key), `weight` (> 0),
    `band` (INTERACTIVE or BATCH), `cost` (tokens, >= 1)."""

    __slots__ = ("flow", "weight", "band", "cost")

    def __init__(self, flow: tuple, weight: float = DEFAULT_WEIGHT, band: int = INTERACTIVE, cost: int = 1):
        self.flow = flow
        self.weight = weight
        self.band = band
        self.cost = cost if cost >= 1 else 1


def share_of(account: "Account | None", cost: int) -> Share:
    """The `Share` of a request of `account` (None: not accounted) costing `cost` tokens."""
    if account is None:
        return Share(SHARED_FLOW, cost=cost)
    flow = ("tenant", account.tenant) if account.tenant is not None else ("key", account.key_id)
    weight, band = DEFAULT_WEIGHT, INTERACTIVE
    for i, q in enumerate(account.quotas):
        w = q.limits.weight
        w = DEFAULT_WEIGHT if w is None else w
        weight = w if i == 0 or w < weight else weight
        if q.limits.band == "batch":
            band = BATCH
    return Share(flow, weight, band, cost)


def request_cost(req: dict, chars: int, output: "OutputBound | None") -> int:
    """Tokens a request not accounted may use, as quotas.py reckons an accounted one's: a token per 4
    characters of prompt, plus its length cap (the first length field it sends, else the model's output
    bound) times its choices (`n`, or `best_of` where larger)."""
    cap = None
    for field in LENGTH_FIELDS:
        v = req.get(field)
        if type(v) is int and v >= 0:
            cap = v
            break
    if cap is None:
        cap = output.tokens if output is not None else 0
    k = req.get("n")
    k = k if type(k) is int and k > 0 else 1
    best = req.get("best_of")
    if type(best) is int and best > k:
        k = best
    return -(-chars // CHARS_PER_TOKEN) + cap * k


class Waiter:
    """One request waiting for a slot: its future (set when a slot is handed to it), flow, start and finish
    tags."""

    __slots__ = ("fut", "flow", "start", "finish", "seq")

    def __init__(self, fut: asyncio.Future, flow: "Flow", start: float, finish: float, seq: int):
        self.fut = fut
        self.flow = flow
        self.start = start
        self.finish = finish
        self.seq = seq


class Flow:
    """One flow's waiters in arrival order, its finish tag and its weight (of its latest request)."""

    __slots__ = ("key", "band", "finish", "weight", "waiters")

    def __init__(self, key: tuple, band: "Band"):
        self.key = key
        self.band = band
        self.finish = 0.0
        self.weight = DEFAULT_WEIGHT
        self.waiters: deque[Waiter] = deque()


class Band:
    """One priority band: its flows, its waiters ordered by start tag (a heap; a waiter that left is
    skipped when it comes up), its virtual time and how many wait in it."""

    __slots__ = ("flows", "heap", "vtime", "waiting")

    def __init__(self) -> None:
        self.flows: dict[tuple, Flow] = {}
        self.heap: list[tuple[float, int, Waiter]] = []
        self.vtime = 0.0
        self.waiting = 0

    def reset(self) -> None:
        self.flows.clear()
        self.heap.clear()
        self.vtime = 0.0


class FairQueue:
    """The waiters of one model's gate. `add` a waiter, `next` the one a freed slot goes to, `remove` one
    that left (cancelled, timed out), `push_out` the one a full queue refuses for a newcomer."""

    def __init__(self) -> None:
        self.bands = (Band(), Band())
        self.waiting = 0
        self._seq = count()
        self._since_batch = 0  # slots handed to interactive in a row while batch waited

    def __len__(self) -> int:
        return self.waiting

    def add(self, fut: asyncio.Future, share: Share) -> Waiter:
        flow, start = self._tag(share)
        band = flow.band
        w = Waiter(fut, flow, start, flow.finish, next(self._seq))
        flow.waiters.append(w)
        heapq.heappush(band.heap, (start, w.seq, w))
        band.waiting += 1
        self.waiting += 1
        return w

    @staticmethod
    def _forget(band: Band) -> None:
        """Drop flows with nobody waiting whose finish tag the band's time has passed (they would start at
        `V` anyway): a long busy period does not keep every flow it ever saw."""
        for key in [k for k, f in band.flows.items() if not f.waiters and f.finish <= band.vtime]:
            del band.flows[key]

    def next(self) -> Waiter | None:
        """Take the waiter the next freed slot goes to (None when nobody waits)."""
        inter, batch = self.bands
        batch_turn = batch.waiting and (not inter.waiting or self._since_batch >= BATCH_EVERY - 1)
        for band in (batch, inter) if batch_turn else (inter, batch):
            while band.heap:  # (a waiter cancelled a moment ago is still counted, until it takes itself out)
                start, _, w = heapq.heappop(band.heap)
                if w.fut.done():
                    continue
                band.vtime = start
                self._since_batch = 0 if band is batch or not batch.waiting else self._since_batch + 1
                self._unlink(w)
                return w
        return None

    def remove(self, w: Waiter) -> None:
        """A waiter that left before a slot came: out of its flow; the flow's latest request gives its tags
        back (it was never served)."""
        flow = w.flow
        try:
            flow.waiters.remove(w)
        except ValueError:
            return  # already taken out
        if flow.finish == w.finish:
            flow.finish = w.start
        self._count_out(flow.band)

    def _unlink(self, w: Waiter) -> None:
        flow = w.flow
        if flow.waiters and flow.waiters[0] is w:
            flow.waiters.popleft()
        else:
            flow.waiters.remove(w)
        self._count_out(flow.band)

    def _count_out(self, band: Band) -> None:
        band.waiting -= 1
        self.waiting -= 1
        if not band.waiting:
            band.reset()  # nobody waits: the band's fairness memory ends with its busy period

    def waits(self, share: Share) -> bool:
        """Whether `share`'s flow has a request waiting."""
        flow = self.bands[share.band].flows.get(share.flow)
        return flow is not None and bool(flow.waiters)

    def charge(self, share: Share) -> None:
        """A request of `share` served without waiting while others wait (the gate's headroom): its flow's
        finish tag moves on as if it had waited, so headroom is no way around its share."""
        self._tag(share)

    def _tag(self, share: Share) -> tuple["Flow", float]:
        """Start-time fair queuing's tags for one request of `share`: its flow (made if new), its start tag
        (the later of the flow's last finish and the band's virtual time), the flow's finish moved past it."""
        band = self.bands[share.band]
        flow = band.flows.get(share.flow)
        if flow is None:
            if len(band.flows) > 2 * band.waiting + 64:
                self._forget(band)
            flow = band.flows[share.flow] = Flow(share.flow, band)
        start = flow.finish if flow.finish > band.vtime else band.vtime
        flow.finish = start + share.cost / share.weight
        flow.weight = share.weight
        return flow, start

    def victim(self, share: Share) -> Waiter | None:
        """When the queue is full: the waiter to refuse so that a newcomer of `share` may wait instead, or
        None when the newcomer is the one to refuse (see the module's rule)."""
        for b in (BATCH, INTERACTIVE):
            band = self.bands[b]
            if not band.waiting:
                continue
            if b < share.band:
                return None  # a batch newcomer never takes an interactive request's place
            flow = max((f for f in band.flows.values() if f.waiters), key=lambda f: len(f.waiters) / f.weight)
            if b > share.band:
                return flow.waiters[-1]
            mine = self.bands[share.band].flows.get(share.flow)
            have = len(mine.waiters) if mine is not None else 0
            if flow is not mine and (have + 1) / share.weight < len(flow.waiters) / flow.weight:
                return flow.waiters[-1]
            return None
        return None
