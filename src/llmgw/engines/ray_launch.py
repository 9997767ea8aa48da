"""Process launcher for multi-node vLLM on Ray, run inside a shard's process group.

    python -m llmgw.engines.ray_launch join --address HEAD:PORT -- ray start --address HEAD:PORT ... --block
    python -m llmgw.engines.ray_launch head --ray RAY --address HEAD:PORT --nodes N \\
        -- ray start --head ... --block -- vllm serve ... --distributed-executor-backend ray

`join` waits until the Ray head accepts connections (workers are launched before rank 0), then execs the
`ray start` command. `head` starts the Ray head, waits until `ray status` counts N nodes, then starts
`vllm serve`; if either child exits, it stops the other and exits with that child's code, so the
supervisor sees the shard die. SIGTERM stops both children. Never a shell: every command is an argv list.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

ACTIVE_NODE = re.compile(r"^\s*(\d+)\s+node_[0-9A-Za-z]+", re.M)


def count_active_nodes(status_text: str) -> int:
    """Nodes listed under `Active:` in `ray status` output (Ray 2.x format)."""
    m = re.search(r"^Active:\s*$(.*?)^(Pending|Recent failures|Resources):", status_text, re.M | re.S)
    section = m.group(1) if m else status_text
    return sum(int(n) for n in ACTIVE_NODE.findall(section))


def wait_tcp(address: str, timeout_s: float) -> bool:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


def split(argv: list[str]) -> list[list[str]]:
    parts, cur = [], []
    for a in argv:
        if a == "--":
            parts.append(cur)
            cur = []
        else:
            cur.append(a)
    parts.append(cur)
    return parts


def join(address: str, timeout_s: float, command: list[str]) -> int:
    print(f"waiting for the Ray head at {address}", flush=True)
    if not wait_tcp(address, timeout_s):
        print(f"the Ray head at {address} did not come up within {timeout_s:.0f}s", flush=True)
        return 4
    print("joining: " + " ".join(command), flush=True)
    os.execvp(command[0], command)
    return 127  # not reached


def head(ray: str, address: str, nodes: int, timeout_s: float, head_cmd: list[str], serve_cmd: list[str]) -> int:
    children: list[subprocess.Popen] = []

    def stop_all(*_):
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop_all)
    print("starting the Ray head: " + " ".join(head_cmd), flush=True)
    ray_head = subprocess.Popen(head_cmd)
    children.append(ray_head)
    deadline = time.monotonic() + timeout_s
    have = 0
    while True:
        if ray_head.poll() is not None:
            print(f"the Ray head exited with code {ray_head.returncode}", flush=True)
            return ray_head.returncode or 1
        try:
            out = subprocess.run([ray, "status", "--address", address], capture_output=True, text=True, timeout=20).stdout
            have = count_active_nodes(out)
        except (OSError, subprocess.TimeoutExpired):
            have = 0
        if have >= nodes:
            break
        if time.monotonic() > deadline:
            print(f"only {have} of {nodes} Ray nodes joined within {timeout_s:.0f}s", flush=True)
            stop_all()
        time.sleep(2)
    print(f"{have} Ray nodes joined; starting: " + " ".join(serve_cmd), flush=True)
    serve = subprocess.Popen(serve_cmd)
    children.append(serve)
    while True:
        for c in children:
            code = c.poll()
            if code is not None:
                print(f"{'vllm serve' if c is serve else 'the Ray head'} exited with code {code}; stopping the shard",
                      flush=True)
                for other in children:
                    if other.poll() is None:
                        other.terminate()
                return code or 1
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parts = split(argv)
    p = argparse.ArgumentParser(prog="ray_launch")
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("join")
    j.add_argument("--address", required=True)
    j.add_argument("--timeout", type=float, default=900)
    h = sub.add_parser("head")
    h.add_argument("--ray", required=True)
    h.add_argument("--address", required=True)
    h.add_argument("--nodes", type=int, required=True)
    h.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(parts[0])
    if args.cmd == "join":
        return join(args.address, args.timeout, parts[1])
    return head(args.ray, args.address, args.nodes, args.timeout, parts[1], parts[2])


if __name__ == "__main__":
    sys.exit(main())
