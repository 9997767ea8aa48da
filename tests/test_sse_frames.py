"""The stream contract (gateway/sse.py) is the same however the engine's bytes are cut into reads.

`SSEFrames.feed` takes a shortcut for the common chunk (one single-line `data:` event holding a JSON
object) and relays it untouched; these tests feed streams in every cut into two pieces, event by event and
in random pieces, and compare what comes out with the contract applied to the whole stream at once
(`reference` below, written from the module's docstring, independently of `SSEFrames`). The real path (an
engine process writing messy and broken streams through the gateway's listener) is in
tests/test_gateway_api.py.
"""

from __future__ import annotations

import json
import random

import pytest

from llmgw.gateway.sse import DONE, SSEFrames

ERR = b'data: {"error": {"message": "cut"}}\n\n'


def event(i: int, text: str = "tok") -> bytes:
    return b"data: " + json.dumps({"id": "c1", "choices": [{"index": 0, "delta": {"content": f"{text}{i}"}}]}).encode() + b"\n\n"


def reference(stream: bytes) -> bytes:
    """The contract applied to the whole stream: complete events' data and comment lines, up to the
    first `[DONE]`; an unfinished last event is an error, then `[DONE]`."""
    *events, tail = stream.replace(b"\r\n", b"\n").split(b"\n\n")
    out = []
    for e in events:
        lines = [ln for ln in e.split(b"\n") if ln.startswith((b"data:", b":"))]
        if not lines:
            continue
        if any(ln.startswith(b"data:") and ln[5:].strip() == b"[DONE]" for ln in lines):
            return b"".join(out) + DONE
        out.append(b"\n".join(lines) + b"\n\n")
    tail = tail.strip()
    return b"".join(out) + (DONE if tail in (b"", b"data: [DONE]", b"data:[DONE]") else ERR + DONE)


def relay(chunks: list[bytes]) -> bytes:
    frames = SSEFrames()
    return b"".join(frames.feed(c) for c in chunks) + frames.finish(ERR)


STREAMS = {
    "plain": b"".join(event(i) for i in range(5)) + DONE,
    "no [DONE]": b"".join(event(i) for i in range(3)),
    "[DONE] in a token": event(0, "[DONE]") + event(1) + DONE,
    "padded [DONE]": event(0) + b"data:    [DONE]   \n\n" + event(1) + DONE,
    "[DONE] without its blank line": event(0) + b"data: [DONE]",
    "cut mid-event": event(0) + event(1)[:30],
    "CRLF": (event(0) + event(1)).replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n",
    "fields and garbage": (b"event: x\nid: 3\n" + event(0) + b": keep-alive\n\nretry: 5\n\ngarbage\n\n" + event(1)
                           + b"data: a\ndata: b\n\n" + DONE + DONE + event(2)),
    "blank lines": b"\n\n" + event(0) + b"\n" + event(1) + b"\n\n\n" + DONE,
    "not JSON": b"data: plain text\n\n" + event(0) + b"data: [x]\n\n" + DONE,
}


@pytest.mark.parametrize("name", STREAMS)
def test_every_cut_in_two_gives_the_contract(name):
    stream = STREAMS[name]
    want = reference(stream)
    assert want.endswith(DONE) and want.count(b"[DONE]") == want.count(DONE) + stream.count(b'"[DONE]')
    assert relay([stream]) == want
    for i in range(len(stream) + 1):
        assert relay([stream[:i], stream[i:]]) == want, i


@pytest.mark.parametrize("name", STREAMS)
def test_event_by_event_and_random_pieces_give_the_contract(name):
    stream = STREAMS[name]
    want = reference(stream)
    pieces = [p + b"\n\n" for p in stream.split(b"\n\n")]
    pieces[-1] = pieces[-1][:-2]
    assert relay(pieces) == want
    rng = random.Random(name)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(1, 12))))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        assert relay(chunks) == want, cuts


def test_events_are_relayed_as_soon_as_complete_and_untouched():
    frames = SSEFrames()
    e = event(7)
    assert frames.feed(e) is e  # the common chunk passes as the engine wrote it
    assert frames.feed(e[:20]) == b""
    assert frames.feed(e[20:] + e[:5]) == e
    assert frames.feed(e[5:]) == e
    assert frames.feed(DONE) == DONE
    assert frames.feed(e) == b"" and frames.finish(ERR) == b""  # nothing after [DONE], and no second one
