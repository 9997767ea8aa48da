"""A download's progress reaches where operators look (seeds 001): while a node fetches weights from a
slow server, `llmgw ctl replicas` shows bytes of total under the replica, and the line goes away when the
shard moves on (a transition clears it). With no length from the server no percentage is invented."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.dev.procs import free_port
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

SIZE = 4_000_000


class Slow(BaseHTTPRequestHandler):
    def do_GET(self):
        rng = self.headers.get("Range")
        if rng and int(rng[6:].split("-")[0]) >= SIZE:
            # As a file server answers: a body with no length is confirmed whole by a 416 for the bytes
            # after its end (weights/download.py asks for that).
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{SIZE}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        if "nolength" not in self.path:
            self.send_header("Content-Length", str(SIZE))
        self.end_headers()
        sent = 0
        while sent < SIZE:
            self.wfile.write(b"x" * 100_000)
            sent += 100_000
            time.sleep(0.1)  # about 4 s for the whole file

    def log_message(self, *a):
        pass


@pytest.fixture
def slow_server():
    port = free_port()
    srv = ThreadingHTTPServer(("127.0.0.1", port), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}"
    srv.shutdown()


@pytest.mark.parametrize("name,expect", [("w.gguf", "%)"), ("nolength/w.gguf", "MB so far")])
def test_ctl_replicas_shows_download_progress(control_plane, slow_server, name, expect):
    cp = control_plane.start()
    cp.agent("n1")
    # The fetched file is not a real GGUF: the engine is sim, which ignores it; the fetch is what we watch.
    cp.apply({"models": [{"name": "m", "scaling": {"min": 1, "max": 1},
                          "profiles": [{"engine": "sim", "source": f"{slow_server}/{name}"}]}]})

    def line():
        out = cp.ctl("replicas").stdout
        return out if "downloading" in out else None

    out = wait_until(line, timeout_s=20, interval_s=0.3, what="a progress line")
    assert f"n1: downloading {slow_server}/{name}: " in out and expect in out
    if expect == "MB so far":
        assert "%" not in out
    cp.wait_replicas("m", timeout_s=30)
    assert "downloading" not in cp.ctl("replicas").stdout
