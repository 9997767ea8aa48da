"""The gateway's engine client (gateway/upstream.py) on a real socket, for what the relay tests cannot
time: bytes that reach a pooled connection's socket before the event loop has read them, and the TCP
options that make a lost host fail its requests (the relay through the real gateway is tested in
tests/test_gateway_api.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest

from llmgw.gateway.upstream import DEAD_PEER_S, KEEPALIVE_IDLE_S, Upstream, UpstreamTimeout, parse_target
from tests.fake_engine import RawEngine


def engine_in_a_thread() -> tuple[RawEngine, asyncio.AbstractEventLoop]:
    """A RawEngine on a loop of its own, so that it writes while the test blocks its own loop."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = asyncio.run_coroutine_threadsafe(RawEngine().start(), loop).result(10)
    return engine, loop


async def test_a_pooled_connection_with_unread_bytes_is_not_used():
    engine, loop = engine_in_a_thread()
    up = Upstream(10)
    try:
        target = parse_target(engine.url("late"))
        resp = await up.post(target, "/v1/chat/completions", b"{}")
        assert b"answer 1" in await resp.read_whole(1 << 20)
        resp.release()
        assert up.idle[target] == [resp]
        time.sleep(0.5)  # blocks the loop: the unasked answer sits in the socket, not yet read
        again = await up.post(target, "/v1/chat/completions", b"{}")
        assert again is not resp and resp.closed
        assert b"answer 2" in await again.read_whole(1 << 20)
        again.abort()
    finally:
        await up.close()
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


async def test_engine_connections_use_tcp_keepalive_and_a_user_timeout():
    engine = await RawEngine().start()
    up = Upstream(300)
    try:
        resp = await up.post(parse_target(engine.url("plain")), "/v1/chat/completions", b"{}")
        sock = resp.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == DEAD_PEER_S * 1000
        await resp.read_whole(1 << 20)
        resp.abort()
    finally:
        await up.close()
        await engine.close()


async def test_the_read_timeout_counts_from_each_wait_across_a_stream_and_a_reused_connection():
    """One timer per connection serves every wait (a stream waits once per event): a stream whose events
    come 0.1 s apart for longer than the 0.5 s timeout is never cut, on a kept-alive connection whose timer
    was armed by an earlier answer; a stream that then goes silent times out 0.5 s after its last event."""
    engine = await RawEngine().start()
    up = Upstream(0.5)
    try:
        target = parse_target(engine.url(""))  # the path's first segment picks the behaviour
        first = await up.post(target, "/plain", b"{}")
        await first.read_whole(1 << 20)
        first.release()
        for behaviour in ("drip", "dripstall"):
            resp = await up.post(target, f"/{behaviour}", b"{}")
            assert resp is first  # the same connection, and its timer, each time
            events, last = 0, time.monotonic()
            with pytest.raises(UpstreamTimeout) if behaviour == "dripstall" else contextlib.nullcontext():
                while chunk := await resp.next_chunk():
                    events += chunk.count(b"\n\n")
                    last = time.monotonic()
            assert events == 8
            if behaviour == "drip":
                resp.release()
            else:
                assert 0.45 < time.monotonic() - last < 5
                resp.abort()
    finally:
        await up.close()
        await engine.close()
