"""Every listener's limits (http/serving.py), through a real `llmgw server` and raw sockets: half-open and
slow clients, oversized headers and bodies, a client that stops reading, more connections than allowed;
and the node API's own process, which keeps answering heartbeats while the gateway process is frozen.

The limits are scaled down with settings (seconds, not the defaults' tens of seconds); every wait is a
deadline that a correct gateway meets by far and a gateway without the limit never meets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import httpx
import pytest

from llmgw.dev.procs import free_port, wait_port
from tests.fake_engine import FakeEngines
from tests.helpers import REPO, ControlPlane
from tests.test_node_identity import client as node_client, register

pytestmark = pytest.mark.integration

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
SEND_TIMEOUT_S = 2.0
MAX_HEADER_BYTES = 16 << 10
MAX_REQUEST_BYTES = 1 << 20
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
async def engines():
    fe = await FakeEngines().start()
    try:
        yield fe
    finally:
        await fe.close()


async def start_gateway(cp: ControlPlane, models: list[dict], mirror: bool = False) -> ControlPlane:
    """Start the server (no worker, no Temporal needed) and wait until it routes every model."""
    await asyncio.to_thread(cp.start, worker=False, mirror=mirror)
    async with aiohttp.ClientSession() as s:
        async with s.post(cp.admin + "/admin/v1/catalog", json={"catalog": {"models": models}}, headers=cp.admin_headers) as r:
            assert r.status == 200, await r.text()
        deadline = time.monotonic() + 20
        while True:
            async with s.get(cp.gateway + "/v1/models") as r:
                if len((await r.json())["data"]) == len(models):
                    return cp
            assert time.monotonic() < deadline, "the gateway never loaded the catalog"
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def gw(tmp_path_factory, module_database_url, engines):
    cp = ControlPlane(tmp_path_factory.mktemp("limits"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S), LLMGW_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
                      LLMGW_SEND_TIMEOUT_S=str(SEND_TIMEOUT_S), LLMGW_MAX_HEADER_BYTES=str(MAX_HEADER_BYTES),
                      LLMGW_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES), LLMGW_MAX_CONNECTIONS="3000",
                      # every client here is 127.0.0.1: its cap is the listener's (tests/test_listener_clients.py has its own)
                      LLMGW_MAX_CONNECTIONS_PER_CLIENT="3000")
    try:
        yield await start_gateway(cp, [{"name": "echo", "endpoints": [engines.url("echo")]},
                                       {"name": "firehose", "endpoints": [engines.url("firehose")]},
                                       {"name": "slowstream", "endpoints": [engines.url("cancel")]}], mirror=True)
    finally:
        await asyncio.to_thread(cp.stop)


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = 30) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it never does)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"the server still held the connection after {timeout_s}s") from None
    except ConnectionResetError:
        return b""


async def test_half_open_and_silent_connections_are_closed_by_the_header_deadline(gw):
    """300 connections: half say nothing, half send half a request. All are closed after the header
    deadline; those that began a request are told 408. The admin API's and the mirror's listeners too."""
    others = [await asyncio.open_connection("127.0.0.1", gw.ports[name]) for name in ("admin", "mirror")]
    conns = [await asyncio.open_connection("127.0.0.1", gw.ports["gateway"]) for _ in range(300)]
    for i, (_, w) in enumerate(conns):
        if i % 2:
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Le")
    got = await asyncio.gather(*(until_closed(r) for r, _ in conns))
    for i, data in enumerate(got):
        if i % 2:
            assert data.startswith(b"HTTP/1.1 408 "), data[:80]
        else:
            assert data == b""
    for _, w in conns:
        w.close()
    for r, w in others:
        assert await until_closed(r) == b""
        w.close()
    # The same for half a request on a kept-alive connection, after one that was answered.
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    await r.readexactly(length)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: gat")
    assert (await until_closed(r)).startswith(b"HTTP/1.1 408 ")
    w.close()


async def test_a_body_that_does_not_arrive_in_time_gets_408(gw):
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"model\": ")
    data = await until_closed(r)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data, data
    w.close()


async def test_a_request_answered_before_its_body_arrived_gets_that_one_answer(gw):
    # Answered at once (here a 404; a 401 for a request without a key is the same), its body never coming:
    # the connection is closed after the answer (not left to the body deadline), and no 408 follows the
    # answer (two answers to one request).
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(b"POST /v1/nothing-here HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"model\": ")
    data = await until_closed(r)
    assert data.startswith(b"HTTP/1.1 404 ") and data.count(b"HTTP/1.1 ") == 1, data
    w.close()


@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: a\x00b\r\n\r\n",
], ids=["length-and-chunked", "negative-length", "two-lengths", "nul-in-header"])
async def test_a_request_the_parser_refuses_gets_400_in_the_envelope(gw, head):
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(head)
    data = await until_closed(r, 10)
    w.close()
    assert data.startswith(b"HTTP/1.1 400 ") and b"application/json" in data, data
    assert b'"code": "invalid_http"' in data and b"Invalid HTTP request received" not in data, data


async def send_header(port: int, mib: int) -> bytes:
    """A request whose one header is `mib` MiB, sent as fast as the server reads; returns its answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
    try:
        for _ in range(mib * 16):
            w.write(b"a" * (64 << 10))
            await w.drain()
        w.write(b"\r\n\r\n")
    except (ConnectionResetError, BrokenPipeError):
        pass
    data = await until_closed(r)
    w.close()
    return data


async def test_an_oversized_header_is_refused_with_431_before_it_is_read_whole(gw):
    data = await send_header(gw.ports["gateway"], 4)
    assert data.startswith(b"HTTP/1.1 431 ") and b"request_headers_too_large" in data, data[:200]


async def test_an_oversized_header_in_one_write_is_refused_too(gw):
    """A head that arrives whole in one read was not counted (the cap counted across reads only), so a
    header of twice the cap sent at once was served."""
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES) + b"\r\n\r\n")
    data = await until_closed(r)
    w.close()
    assert data.startswith(b"HTTP/1.1 431 ") and b"request_headers_too_large" in data, data[:200]
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])  # under the cap: served
    w.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES - 1024)
            + b"\r\n\r\n")
    data = await until_closed(r)
    w.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]


@pytest.mark.parametrize("parts", [2, 3])
async def test_an_oversized_header_in_two_or_three_reads_is_refused_too(gw, parts):
    """The reads' count missed the read a head began in and the one it ended in: twice the cap sent in two
    reads (seen in CI when one write arrived as two) was served."""
    head = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    step = len(head) // parts + 1
    for i in range(0, len(head), step):
        w.write(head[i:i + step])
        await w.drain()
        await asyncio.sleep(0.2)  # each part its own read
    data = await until_closed(r)
    w.close()
    assert data.startswith(b"HTTP/1.1 431 ") and b"request_headers_too_large" in data, data[:200]


async def test_a_body_over_the_limit_gets_413_in_the_envelope(gw):
    """Announced too large (Content-Length): refused at once, before a byte of the body is sent (the app
    would wait for it). Sent anyway by an HTTP client: the same 413, which the client gets to read. Both
    are the OpenAI envelope with `request_too_large`."""
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"])
    w.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (2 * MAX_REQUEST_BYTES))
    data = await until_closed(r, timeout_s=BODY_TIMEOUT_S + 20)
    assert data.startswith(b"HTTP/1.1 413 ") and b"request_too_large" in data, data[:200]
    w.close()
    async with aiohttp.ClientSession() as s:
        body = b'{"model": "echo", "input": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
        async with s.post(gw.gateway + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"


async def test_a_client_that_stops_reading_is_dropped_and_its_engine_request_cancelled(gw, engines):
    """The client asks for a stream and reads nothing: once the gateway could send nothing for
    `send_timeout_s`, it drops the client, and the engine sees its request cancelled."""
    engines.state["firehose_cancelled"] = None
    r, w = await asyncio.open_connection("127.0.0.1", gw.ports["gateway"], limit=1 << 16)
    body = b'{"model": "firehose", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await w.drain()
    deadline = time.monotonic() + 40
    while engines.state["firehose_cancelled"] is None:
        assert time.monotonic() < deadline, "the engine kept streaming into a client that reads nothing"
        await asyncio.sleep(0.1)
    w.close()


async def latencies(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url, json=CHAT) as r:
                await r.read()
                assert r.status == 200
            out.append(time.perf_counter() - t0)
    return sorted(out)


async def test_slow_and_oversized_clients_do_not_move_the_p99_of_well_behaved_ones(gw):
    """500 clients trickling their headers a byte a second (reconnecting whenever they are closed) and
    two sending 32 MiB headers twice a second, from another process: the well-behaved requests' p99
    stays within a small factor of its value without them (measured 7 -> 40 ms on a loaded 2-core
    machine). This shows the limits together; the tests above are the ones that fail when one limit is
    removed (without the header cap this one once measured 14 ms -> 2.3 s, but how much the quadratic
    header joining costs depends on how the big headers are split into reads)."""
    url = gw.gateway + "/v1/chat/completions"
    await latencies(url, 20)  # warm up
    before = await latencies(url, 100)
    attack = subprocess.Popen([sys.executable, "-m", "tests.slow_clients", "--port", str(gw.ports["gateway"]),
                               "--slow", "500", "--big", "2", "--big-mib", "32"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(attack.stdout.readline), 60)
        assert line.strip() == b"ready", line
        await asyncio.sleep(1.0)  # the big headers are being sent
        during = await latencies(url, 100)
        assert attack.poll() is None, attack.stdout.read()
    finally:
        os.killpg(attack.pid, signal.SIGKILL)
        attack.wait(10)
    p99_before, p99_during = before[98], during[98]
    print(f"p50 {before[49] * 1e3:.1f} -> {during[49] * 1e3:.1f} ms, p99 {p99_before * 1e3:.1f} -> "
          f"{p99_during * 1e3:.1f} ms with 500 slow clients and 2 sending 32 MiB headers")
    assert p99_during < max(4 * p99_before, p99_before + 0.25), (before, during)


async def test_at_the_connection_limit_idle_connections_make_way_and_busy_ones_do_not(
        tmp_path_factory, module_database_url, engines):
    """`max_connections` 8: eight idle connections do not keep a ninth client out (the oldest idle one is
    closed for it); eight requests in progress do (503 `too_many_connections`), and none of them is cut."""
    cp = ControlPlane(tmp_path_factory.mktemp("connlimit"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_MAX_CONNECTIONS="8")
    try:
        await start_gateway(cp, [{"name": "echo", "endpoints": [engines.url("echo")]},
                                 {"name": "firehose", "endpoints": [engines.url("firehose")]},
                                 {"name": "slowstream", "endpoints": [engines.url("cancel")]}])
        port = cp.ports["gateway"]
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.gateway + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
        closed = 0
        for reader, w in idle:
            try:
                closed += await asyncio.wait_for(reader.read(), 0.5) == b""
            except asyncio.TimeoutError:
                pass
            w.close()

        assert closed >= 1, "no idle connection made way"
        busy = []
        for _ in range(8):
            reader, w = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"model": "slowstream", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert (await asyncio.wait_for(reader.readuntil(b"data: {"), 20)).startswith(b"HTTP/1.1 200")
            busy.append((reader, w))
        reader, w = await asyncio.open_connection("127.0.0.1", port)
        data = await until_closed(reader)
        assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data, data
        w.close()
        for reader, w in busy:  # still streaming
            await asyncio.wait_for(reader.readuntil(b"data: {"), 10)
            w.close()
    finally:
        await asyncio.to_thread(cp.stop)


def test_the_node_api_answers_heartbeats_while_the_gateway_process_is_frozen(control_plane):
    """The node API runs in a process of its own (server.py): with the gateway's process stopped
    (SIGSTOP: the public port accepts but nothing answers), nodes still register and heartbeat."""
    cp = control_plane
    server = cp.spawn("server", "server")
    wait_port(cp.ports["gateway"], 60, server.proc, "gateway")
    wait_port(cp.ports["node_api"], 60, server.proc, "node API")
    cp.node_env("node-a")
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.get(cp.gateway + "/healthz", timeout=2)  # frozen indeed
        with node_client(cp, cp.pki, "node-a") as c:
            assert c.post("/node/v1/register", json=register("node-a")).status_code == 200
            for _ in range(3):
                r = c.post("/node/v1/heartbeat", json={"node_id": "node-a", "boot_id": "b1"})
                assert r.status_code == 200 and r.json()["ok"] is True, r.text
                time.sleep(0.5)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert httpx.get(cp.gateway + "/healthz", timeout=10).status_code == 200
