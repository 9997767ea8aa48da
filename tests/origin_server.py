"""A plain HTTP file server standing in for "any HTTP server" weights are mirrored from, with the faults
real ones have, chosen per path. Runs in a thread (`Origin`) or as a process that a test can SIGKILL and
start again on the same port (`python -m tests.origin_server ROOT PORT CONFIG_JSON`).

It serves ROOT with Range support (`bytes=a-`, `bytes=a-b`; 416 with `bytes */size`), by sendfile when
no fault applies. `config` (JSON, keyed by URL path unless said otherwise):
- `rate`: bytes per second for every response (0: unthrottled);
- `drop`: {path: offset}: the first response of `path` that reaches `offset` closes the connection there;
- `gone_after_drop`: [paths]: once dropped, the path answers 404 (a file deleted mid-download);
- `bad_range`: [paths]: a ranged request gets 206 with the whole file and `Content-Range: bytes 0-...`;
- `ignore_range`: [paths]: ranged requests get 200 and the whole file;
- `lie_416`: {path: total}: every ranged request gets 416 claiming `bytes */total`;
- `drip`: {path: seconds}: one byte every `seconds`;
- `redirect`: {path: location};  `html`: [paths]: a web page;  `gzip`: [paths]: `Content-Encoding: gzip`;
- `documents`: {path: JSON value}: served as `application/json` (a version manifest, say);
- `no_length`: [paths]: no Content-Length (the body ends when the connection closes, as a cut one does);
- `declare_sha`: [paths]: `X-Llmgw-Sha256` of the file on 200 and 206, as the mirror sends it;
- `drip_head`: {path: seconds}: the status line and headers one byte every `seconds`.
Every response is recorded (`/_log`, and appended to the file `log_file` names when set, which survives a
restart): path, status, range start, bytes sent.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _record(self, path: str, status: int, start: int, sent: int) -> None:
        entry = {"path": path, "status": status, "start": start, "sent": sent, "range": self.headers.get("Range")}
        with self.server.lock:
            self.server.log.append(entry)
            if self.server.config.get("log_file"):
                with open(self.server.config["log_file"], "a") as f:
                    f.write(json.dumps(entry) + "\n")

    def _serve(self, head: bool) -> None:
        cfg = self.server.config
        path = unquote(urlsplit(self.path).path)
        if path == "/_log":
            body = json.dumps(self.server.log).encode()
            return self._reply(200, body, "application/json")
        if path in cfg.get("redirect", {}):
            self.send_response(302)
            self.send_header("Location", cfg["redirect"][path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return self._record(path, 302, 0, 0)
        if path in cfg.get("documents", {}):
            self._record(path, 200, 0, 0)
            return self._reply(200, json.dumps(cfg["documents"][path]).encode(), "application/json")
        if path in cfg.get("html", []):
            return self._reply(200, b"<!doctype html><html><body>a repository page</body></html>", "text/html; charset=utf-8")
        file = (self.server.root / path.lstrip("/")).resolve()
        gone = path in cfg.get("gone_after_drop", []) and path in self.server.dropped
        if self.server.root.resolve() not in file.parents or not file.is_file() or gone:
            self._record(path, 404, 0, 0)
            return self._reply(404, b"not found", "text/plain")
        size = file.stat().st_size
        start, end = 0, size - 1
        status = 200
        m = _RANGE.fullmatch(self.headers.get("Range", "").strip())
        if m and path in cfg.get("lie_416", {}):
            self._record(path, 416, int(m[1]), 0)
            return self._reply(416, b"", "text/plain", {"Content-Range": f"bytes */{cfg['lie_416'][path]}"})
        if m and path not in cfg.get("ignore_range", []):
            start = int(m[1])
            end = min(int(m[2]), size - 1) if m[2] else size - 1
            if start >= size:
                self._record(path, 416, start, 0)
                return self._reply(416, b"", "text/plain", {"Content-Range": f"bytes */{size}"})
            status = 206
            if path in cfg.get("bad_range", []):
                start, end = 0, size - 1
        length = end - start + 1
        if path in cfg.get("drip_head", {}):
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx":
                try:
                    self.connection.sendall(bytes([b]))
                except OSError:
                    break
                time.sleep(cfg["drip_head"][path])
            self.close_connection = True
            return self._record(path, 200, 0, 0)
        self.send_response(status)
        ctype = "application/json" if path.endswith(".json") else "application/octet-stream"
        self.send_header("Content-Type", ctype)
        if path in cfg.get("no_length", []):
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(length))
        if path in cfg.get("declare_sha", []):
            import hashlib
            self.send_header("X-Llmgw-Sha256", hashlib.sha256(file.read_bytes()).hexdigest())
        self.send_header("Accept-Ranges", "bytes")
        if path in cfg.get("gzip", []):
            self.send_header("Content-Encoding", "gzip")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        sent = self._body(path, file, start, length)
        self._record(path, status, start, sent)

    def _body(self, path: str, file: Path, start: int, length: int) -> int:
        cfg = self.server.config
        rate = cfg.get("rate", 0)
        drip = cfg.get("drip", {}).get(path)
        drop_at = cfg.get("drop", {}).get(path)
        with self.server.lock:
            if drop_at is not None and path in self.server.dropped:
                drop_at = None
        self.wfile.flush()
        sent = 0
        try:
            with open(file, "rb") as f:
                if not rate and not drip and drop_at is None:
                    return self.connection.sendfile(f, start, length)
                f.seek(start)
                step = 1 if drip else 64 << 10
                t0 = time.monotonic()
                while sent < length:
                    n = min(step, length - sent)
                    if drop_at is not None and start + sent + n >= drop_at:
                        n = max(0, drop_at - start - sent)
                        self.connection.sendall(f.read(n))
                        sent += n
                        with self.server.lock:
                            self.server.dropped.add(path)
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return sent
                    self.connection.sendall(f.read(n))
                    sent += n
                    if drip:
                        time.sleep(drip)
                    elif rate:
                        ahead = sent / rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        return sent

    def _reply(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:  # clients hang up mid-answer on purpose
        pass

    def __init__(self, root: Path, port: int, config: dict, host: str = "127.0.0.1"):
        self.root = root
        self.config = config
        self.log: list[dict] = []
        self.dropped: set[str] = set()
        self.lock = threading.Lock()
        super().__init__((host, port), _Handler)


class Origin:
    """The origin in a thread of the test process: `url`, `log()`, `stop()`."""

    def __init__(self, root: Path, port: int, config: dict | None = None, host: str = "127.0.0.1"):
        self.server = _Server(root, port, config or {}, host)
        self.port = port
        self.url = f"http://{host}:{port}"
        # A short poll: shutdown() waits for the loop's next look, 0.5 s by default, and dozens of tests stop one.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    @property
    def config(self) -> dict:
        return self.server.config

    def log(self, path: str | None = None) -> list[dict]:
        with self.server.lock:
            return [e for e in self.server.log if path is None or e["path"] == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    root, port, config = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    server = _Server(root, port, config, config.get("host", "127.0.0.1"))
    print(f"origin listening on {port}", flush=True)
    try:
        server.serve_forever()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
