"""Python's cyclic garbage collector held off while a reconcile pass builds its snapshot and plan (issue 42).

A pass at 10k nodes makes some 100k objects that live for the pass (rows, the snapshot, the plan). Each
time enough of them survive a young collection, CPython runs a full one over the whole heap (the worker's
memos included): that was 40 % of a pass's read at that size. They are freed by reference counting when
the pass ends, so the collector has nothing to find in them meanwhile; it is held off for the pass and
runs as usual after. Passes that overlap (a rollout step beside a decide) share one hold.
"""

from __future__ import annotations

import contextlib
import gc

_holders = 0
_resume = False  # the collector was on when the first holder came: it is turned on again when the last leaves


@contextlib.contextmanager
def gc_paused():
    global _holders, _resume
    if _holders == 0:
        _resume = gc.isenabled()
        gc.disable()
    _holders += 1
    try:
        yield
    finally:
        _holders -= 1
        if _holders == 0 and _resume:
            gc.enable()
