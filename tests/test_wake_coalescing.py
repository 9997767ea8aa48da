"""The node API's wake-ups of the reconciler (`LazyClient.wake_soon`) coalesce: while one signal is under way,
those asked meanwhile go as one signal after it, naming the first reason and how many more (issue 42: a
registration burst of 2,000 simulated nodes sent 2,000 signals at once, 1,295 of them timed out). Every
event is still followed by a signal sent after it."""

from __future__ import annotations

import asyncio

from llmgw.config import Settings
from llmgw.temporal import LazyClient


class Recorder(LazyClient):
    def __init__(self, delay_s: float):
        super().__init__(Settings())
        self.delay_s = delay_s
        self.sent: list[str] = []
        self.under_way = 0
        self.most_at_once = 0

    async def wake(self, reason: str) -> bool:
        self.under_way += 1
        self.most_at_once = max(self.most_at_once, self.under_way)
        try:
            await asyncio.sleep(self.delay_s)
            self.sent.append(reason)
            return True
        finally:
            self.under_way -= 1


async def test_a_burst_of_wakes_is_one_signal_then_one_more_for_the_rest():
    c = Recorder(0.05)
    for i in range(1000):
        c.wake_soon(f"node n{i} registered")
    await asyncio.sleep(0.3)
    assert c.sent == ["node n0 registered", "node n1 registered (and 998 more)"] and c.most_at_once == 1
    c.wake_soon("node n1000 left")  # after the burst, alone: sent at once, as it is
    await asyncio.sleep(0.1)
    assert c.sent[-1] == "node n1000 left" and not c._wakes


async def test_a_wake_asked_while_one_times_out_is_still_sent_after_it():
    c = Recorder(10.0)
    c.wake_soon("first", timeout_s=0.05)  # Temporal away: this one times out
    c.wake_soon("second")
    await asyncio.sleep(0.01)  # (the first is under way, asleep for 10 s)
    c.delay_s = 0.01
    await asyncio.sleep(0.3)
    assert c.sent == ["second"] and not c._wakes
