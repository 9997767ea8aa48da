"""A weights server whose downloads the test holds: it sends the first `head` bytes of a file, then waits
until `release()`, then sends the rest. HTTP Range is honoured (so a fetch can resume), and every request is
recorded with its Range. A profile's `source: http://...` points at it; the real fetcher downloads from it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmgw.dev.procs import free_port


class SlowSource:
    def __init__(self, size: int = 4 << 20, head: int = 1 << 20):
        self.size = size
        self.head = head
        self.body = bytes(range(256)) * (size // 256)
        self.released = threading.Event()
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.served_head = threading.Event()  # some download got the first `head` bytes and is held
        source = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                rng = self.headers.get("Range")
                source.requests.append((self.path, rng))
                start = int(rng[6:].split("-")[0]) if rng else 0
                total = len(source.body)
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
                self.send_header("Content-Length", str(total - start))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                try:
                    pos = start
                    if pos < source.head:
                        self.wfile.write(source.body[pos:source.head])
                        self.wfile.flush()
                        pos = source.head
                        source.served_head.set()
                    while not source.released.wait(0.2):
                        pass
                    self.wfile.write(source.body[pos:])
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="slow-source", daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def release(self) -> None:
        self.released.set()

    def hold(self) -> None:
        self.released.clear()
        self.served_head.clear()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
