"""The multi-node vLLM launcher with real processes, standing in fake `ray` and `vllm` executables (there
is no GPU here): a worker launched first waits for the Ray head; rank 0 starts `vllm serve` only once
every node has joined; stopping the shard's process group stops Ray and vLLM together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from llmgw.dev.procs import free_port
from tests.helpers import wait_until

FAKE_RAY = r'''#!PYTHON
import os, socket, sys, time, pathlib
args = sys.argv[1:]
d = pathlib.Path(os.environ["FAKE_RAY_DIR"])
def arg(flag):
    return args[args.index(flag) + 1]
if args[0] == "status":
    n = len(list(d.glob("node-*")))
    print("Node status\n-----\nActive:\n" + "".join(f" 1 node_{i:012x}\n" for i in range(n)) + "Pending:\n (no pending nodes)")
    sys.exit(0)
if "--head" in args:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(arg("--port")))); s.listen(16)
    (d / "node-head").write_text(str(os.getpid()))
else:
    host, port = arg("--address").rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()
    (d / f"node-{arg('--node-ip-address')}").write_text(str(os.getpid()))
print("Ray runtime started.", flush=True)
while True:
    time.sleep(1)
'''

FAKE_VLLM = r'''#!PYTHON
import sys, http.server
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def script(path, text):
    path.write_text(text.replace("PYTHON", sys.executable))
    path.chmod(0o755)
    return str(path)


def test_worker_waits_for_head_and_vllm_starts_after_all_joined(tmp_path):
    ray = script(tmp_path / "ray", FAKE_RAY)
    vllm = script(tmp_path / "vllm", FAKE_VLLM)
    env = dict(os.environ, FAKE_RAY_DIR=str(tmp_path))
    ray_port, http_port = free_port(), free_port()
    address = f"127.0.0.1:{ray_port}"
    launcher = [sys.executable, "-m", "llmgw.engines.ray_launch"]
    worker = subprocess.Popen(launcher + ["join", "--address", address, "--", ray, "start", "--address", address,
                                          "--node-ip-address", "10.0.0.2", "--block"], env=env, start_new_session=True)
    head = subprocess.Popen(launcher + ["head", "--ray", ray, "--address", address, "--nodes", "3", "--",
                                        ray, "start", "--head", "--port", str(ray_port), "--block", "--",
                                        vllm, "serve", "m", "--port", str(http_port)], env=env, start_new_session=True)
    late = None
    try:
        wait_until(lambda: (tmp_path / "node-10.0.0.2").exists(), timeout_s=20, what="the worker joined the head")
        # Only 2 of 3 nodes: vllm serve must not start yet.
        time.sleep(3)
        assert not _up(http_port)
        late = subprocess.Popen(launcher + ["join", "--address", address, "--", ray, "start", "--address", address,
                                            "--node-ip-address", "10.0.0.3", "--block"], env=env, start_new_session=True)
        wait_until(lambda: _up(http_port), timeout_s=20, what="vllm serve after every node joined")
        group = [p for p in psutil.process_iter() if _pgid(p) == head.pid]
        assert len(group) >= 3  # launcher, ray head, vllm serve
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(15)
        time.sleep(0.5)
        assert not [p for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for p in (worker, head, late):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _pgid(p):
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None
