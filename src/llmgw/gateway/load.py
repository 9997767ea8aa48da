"""This gateway's load per model, sampled every second and reported for the planner (issue 13).

Per model: requests in flight (forwarded to an engine), queued (held for a load; not those waiting for a
slot under the model's `limits.max_concurrency`, a cap per gateway that more replicas would not lift), the peak of in flight + queued over the model's `scaling.scale_down_delay` (so a
replica is drained only after load stayed low that long), and requests served per second. Every gateway
reports its own rows (db/load_repo.py); the planner sums the live ones (placement/scale.py).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from llmgw.db.load_repo import ModelLoad

if TYPE_CHECKING:
    from llmgw.gateway.demand import Usage

SERVED_WINDOW_S = 5.0  # served_per_s is averaged over this long


class LoadSampler:
    """Turns the request path's counters (`Usage`: in flight, served; `waiting`: held for a load) and the
    admission queues (`queued(name)`) into one `ModelLoad` per model per second. `window(name)` is the
    seconds the peak is taken over (the model's scale_down_delay)."""

    def __init__(self, usage: "Usage", waiting: dict[str, int], queued: Callable[[str], int],
                 window: Callable[[str], float]):
        self.usage = usage
        self.waiting = waiting
        self._queued = queued
        self._window = window
        self._history: dict[str, deque[tuple[float, int, int]]] = {}  # (time, in flight + queued, served)

    def sample(self, now: float) -> list[ModelLoad]:
        """Record this second's load for every model seen and return what to report."""
        out = []
        names = {m for m, n in self.usage.in_flight.items() if n} | {m for m, n in self.waiting.items() if n}
        for name in names | set(self._history):
            in_flight = self.usage.in_flight.get(name, 0)
            queued = self.waiting.get(name, 0) + self._queued(name)
            served = self.usage.served.get(name, 0)
            hist = self._history.setdefault(name, deque())
            hist.append((now, in_flight + queued, served))
            window = self._window(name)
            while len(hist) > 1 and hist[0][0] < now - max(window, SERVED_WINDOW_S):
                hist.popleft()
            peak = max(load for t, load, _ in hist if t >= now - window)
            then = next(h for h in hist if h[0] >= now - SERVED_WINDOW_S)
            rate = (served - then[2]) / (now - then[0]) if then[0] < now else 0.0
            x = ModelLoad(name, in_flight, queued, peak, round(rate, 3))
            out.append(x)
            if x.idle:  # nothing for a whole window: forget it until it is asked for again
                del self._history[name]
        return out
