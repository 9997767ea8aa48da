"""Python's cyclic garbage collector, tuned for the HTTP processes (the gateway's, the node API's; issue 42).

CPython collects its youngest generation each time allocations outnumber frees by 700, and every tenth of those
collections also walks the next generation, every hundredth all objects. A server handling a burst (1,000
streams opened at once) allocates a request's parser, task, futures and buffers for each, and with the
defaults the gateway spent about half of its CPU collecting (py-spy put the samples on allocation sites:
`create_task`, a new upstream connection's parser); the burst's first tokens came 29 % later through the
gateway than directly, and 1-4 % sooner with this (bench/streams.py).

`tune(gen0)` collects once, freezes what exists then (modules, the apps, settings, compiled schemas: long-lived
by construction, so never walked again, `gc.freeze`), and collects the youngest generation every `gen0`
allocations. Reference counting still frees nearly everything at once; only cycles wait longer, at most
`gen0` objects' worth of them.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def tune(gen0: int) -> None:
    """Freeze the start-up heap and raise the youngest generation's threshold to `gen0` (0: leave the defaults)."""
    if gen0 <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
    log.info("the collector collects its youngest generation every %d allocations (%d start-up objects frozen)",
             gc.get_threshold()[0], gc.get_freeze_count())
