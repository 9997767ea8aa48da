"""docker-compose.yml run for real (issue 44): podman-compose brings the stack up with CI's stand-ins for the
third-party images (deploy/ci/compose.ci.yml, built by scripts/compose-ci), and the test checks what an
operator would: every service healthy, the sim model answering through the gateway, the simulated node
registered over mTLS with a certificate the `pki` service made, Prometheus scraping every target, traces
exported, and a restart of the gateway that leaves the node's engine running; then `down` leaves no
container, network or volume of the project.

Without podman, podman-compose or the images (scripts/compose-ci makes them) the test is skipped, unless
LLMGW_REQUIRE_PODMAN=1 (as in CI, .ci/run), where their absence fails it.

Order of start: Debian 12's podman (4.3) cannot wait for `service_healthy` (podman-compose ignores the
condition below podman 4.6) and, without systemd, runs no healthcheck on a timer. So the test starts the
services level by level along docker-compose.yml's `depends_on`, and before the next level it runs each
started service's own healthcheck (`podman healthcheck run`) until it passes, or waits for a one-shot
service to exit 0: the order and the conditions `docker compose up --wait` would keep."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.dev.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parent.parent
FILES = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "deploy/ci/compose.ci.yml")]
# Each published port of docker-compose.yml: (its service, the port in the container).
PUBLISHED = {"GATEWAY": ("server", 8080), "ADMIN": ("server", 8081), "NODE_API": ("server", 8443),
             "MIRROR": ("mirror", 8082), "TEMPORAL": ("temporal", 7233), "PROMETHEUS": ("prometheus", 9090)}
CONTAINERS_CONF = str(REPO / "deploy/ci/containers.conf")
VENV = Path(os.environ.get("LLMGW_COMPOSE_VENV")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "podman-compose")
PODMAN_COMPOSE = VENV / "bin" / "podman-compose"
IMAGES = ["localhost/llmgw-ci/debian:bookworm", "localhost/llmgw-ci/postgres:latest",
          "localhost/llmgw-ci/temporal:latest", "localhost/llmgw-ci/prometheus:latest",
          "localhost/llmgw-ci/llmgw:latest"]
LEVEL_TIMEOUT_S = 150


def podman(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout,
                          env={**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF})


def require_podman() -> None:
    missing = []
    if not shutil.which("podman"):
        missing.append("podman")
    elif not PODMAN_COMPOSE.exists():
        missing.append(f"podman-compose in {VENV}")
    else:
        missing += [i for i in IMAGES if podman("image", "exists", i, check=False).returncode != 0]
    if missing:
        why = f"needs {', '.join(missing)}: run scripts/compose-ci (.ci/run does)"
        if os.environ.get("LLMGW_REQUIRE_PODMAN") == "1":
            pytest.fail(why)
        pytest.skip(why)


def start_levels(services: dict[str, dict]) -> list[list[str]]:
    """The services in the order `depends_on` allows, as levels: each level's services depend only on
    earlier levels'."""
    done: set[str] = set()
    levels = []
    while len(done) < len(services):
        level = sorted(n for n, s in services.items()
                       if n not in done and set(s.get("depends_on") or {}) <= done)
        assert level, f"a cycle in depends_on among {set(services) - done}"
        levels.append(level)
        done |= set(level)
    return levels


class Stack:
    """One compose project with its own name, free host ports and secrets."""

    def __init__(self, log_dir: Path):
        self.project = f"llmgwci{uuid.uuid4().hex[:10]}"
        self.ports = {p: free_port() for p in PUBLISHED}
        self.env = {**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF, "POSTGRES_PASSWORD": secrets.token_hex(16)}
        self.log = log_dir / "podman-compose.log"
        ports: dict[str, list[str]] = {}
        for p, (service, inside) in PUBLISHED.items():
            ports.setdefault(service, []).append(f"127.0.0.1:{self.ports[p]}:{inside}")
        (log_dir / "ports.yml").write_text("services:\n" + "".join(
            f"  {service}:\n    ports: !override {json.dumps(published)}\n" for service, published in ports.items()))
        self.files = [*FILES, "-f", str(log_dir / "ports.yml")]
        compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
        # Services without a profile: what `up` starts (compose.ci.yml puts temporal-ui in profile `ui`).
        ci = yaml.load((REPO / "deploy/ci/compose.ci.yml").read_text(), Loader=_CiLoader)
        self.services = {n: s for n, s in compose["services"].items()
                         if not (ci["services"].get(n) or {}).get("profiles")}
        self.one_shot = {n for n, s in self.services.items() if s.get("restart") == "no"}

    def compose(self, *args: str, timeout: float = 300) -> None:
        with self.log.open("a") as log:
            log.write(f"\n$ podman-compose {' '.join(args)}\n")
            log.flush()
            r = subprocess.run([str(PODMAN_COMPOSE), "-p", self.project, *self.files, *args], cwd=REPO, env=self.env,
                               stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        assert r.returncode == 0, f"podman-compose {' '.join(args)}: exit {r.returncode} (see {self.log})"

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def up(self) -> list[str]:
        """Start every level and wait for it; returns how long each took, for the test's output."""
        took = []
        for level in start_levels(self.services):
            t0 = time.monotonic()
            self.compose("up", "-d", "--no-deps", *level)
            for service in level:
                self.wait_ready(service)
            took.append(f"{'+'.join(level)} {time.monotonic() - t0:.0f} s")
        return took

    def wait_ready(self, service: str) -> None:
        name = self.container(service)
        if service in self.one_shot:
            code = podman("wait", name, timeout=LEVEL_TIMEOUT_S).stdout.strip()
            assert code == "0", f"{service} exited {code}:\n{podman('logs', name, check=False).stderr[-3000:]}"
            return
        self.wait_healthy(service)

    def wait_healthy(self, service: str) -> None:
        name = self.container(service)
        deadline = time.monotonic() + LEVEL_TIMEOUT_S
        while True:
            r = podman("healthcheck", "run", name, check=False)
            if r.returncode == 0:
                return
            state = podman("inspect", "-f", "{{.State.Status}}", name, check=False).stdout.strip()
            if state in ("exited", "stopped") or time.monotonic() > deadline:
                logs = podman("logs", "--tail", "40", name, check=False)
                pytest.fail(f"{service} not healthy ({state}, {r.stdout.strip()} {r.stderr.strip()}):\n"
                            f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
            time.sleep(1)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        return {
            "containers": podman("ps", "-a", "-q", "--filter", label, check=False).stdout.split(),
            "volumes": [v for v in podman("volume", "ls", "-q", check=False).stdout.split()
                        if v.startswith(self.project + "_")],
            "networks": [n for n in podman("network", "ls", "-q", "--format", "{{.Name}}", check=False).stdout.split()
                         if n.startswith(self.project + "_")],
        }

    def force_clean(self) -> None:
        """What `down -v` should have removed, removed by name (never anything of another project)."""
        left = self.leftovers()
        for c in left["containers"]:
            podman("rm", "-f", "-t", "0", c, check=False)
        for v in left["volumes"]:
            podman("volume", "rm", "-f", v, check=False)
        for n in left["networks"]:
            podman("network", "rm", "-f", n, check=False)


class _CiLoader(yaml.SafeLoader):
    """Reads compose.ci.yml's `!override`/`!reset` tags as their plain values."""


_CiLoader.add_multi_constructor("!", lambda loader, suffix, node: (
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)))


@pytest.fixture
def stack(tmp_path):
    require_podman()
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        try:
            s.compose("down", "-v", "-t", "5", timeout=180)
        finally:
            s.force_clean()
    assert s.leftovers() == {"containers": [], "volumes": [], "networks": []}


def eventually(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, AssertionError, KeyError, ValueError) as e:
            last = e
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def chat(gateway: str, key: str) -> str:
    r = httpx.post(f"{gateway}/v1/chat/completions", timeout=20, headers={"Authorization": f"Bearer {key}"},
                   json={"model": "sim-small", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, (r.status_code, r.text[:300])
    return r.json()["choices"][0]["message"]["content"]


def node_api_get(address: tuple[str, int], ctx: ssl.SSLContext) -> bytes | OSError:
    """The first bytes the node API answers to GET /healthz over TLS with `ctx`, or why the connection failed
    (with TLS 1.3 a refused client certificate shows at the first read)."""
    try:
        with socket.create_connection(address, timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=address[0]) as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return tls.recv(100)
    except OSError as e:  # ssl.SSLError is one
        return e


def engine_processes(container: str) -> set[tuple[str, str]]:
    """(pid, command) of the sim engines running in the agent's container."""
    out = podman("top", container, "pid", "args").stdout.splitlines()[1:]
    return {(line.split(None, 1)[0], line.split(None, 1)[1]) for line in out if "llmgw.engines.sim_server" in line}


def test_compose_up_serves_a_sim_model_and_survives_a_gateway_restart(stack, tmp_path):
    started = time.monotonic()
    levels = stack.up()
    up_s = time.monotonic() - started

    # Every service started is healthy (its own healthcheck, run now, again until it passes: one probe may
    # outlast its 5 s timeout on a loaded machine; a container that exited fails it), every one-shot service
    # exited 0.
    states = json.loads(podman("ps", "-a", "--format", "json", "--filter",
                               f"label=io.podman.compose.project={stack.project}").stdout)
    by_service = {c["Labels"]["com.docker.compose.service"]: c for c in states}
    assert set(by_service) == set(stack.services)
    for service in stack.services:
        if service in stack.one_shot:
            assert by_service[service]["ExitCode"] == 0, service
        else:
            stack.wait_healthy(service)

    server = stack.container("server")
    token = podman("exec", server, "cat", "/var/lib/llmgw/admin.token").stdout.strip()
    admin = f"http://127.0.0.1:{stack.ports['ADMIN']}"
    auth = {"Authorization": f"Bearer {token}"}
    gateway = f"http://127.0.0.1:{stack.ports['GATEWAY']}"

    # The simulated node registered through the node API, which takes only a client certificate of the
    # pki service's CA: the agent's certificate is that CA's, and the API refuses a client without one.
    nodes = eventually(lambda: [n for n in httpx.get(f"{admin}/admin/v1/nodes", headers=auth, timeout=10).json()
                                if n["id"] == "sim-1" and n.get("registered_at")], 60, "sim-1 registered")
    assert nodes[0]["inventory"]["gpus"], nodes
    pki = tmp_path / "pki"
    pki.mkdir()
    for f in ("ca.crt", "node-sim-1.crt", "node-sim-1.key"):
        podman("cp", f"{stack.container('pki')}:/pki/{f}", str(pki / f))
    issuer = subprocess.run(["openssl", "verify", "-CAfile", pki / "ca.crt", pki / "node-sim-1.crt"],
                            capture_output=True, text=True)
    assert issuer.returncode == 0, issuer.stdout + issuer.stderr
    node_api = ("127.0.0.1", stack.ports["NODE_API"])
    ctx = ssl.create_default_context(cafile=pki / "ca.crt")  # the server's certificate is the pki CA's too
    no_cert = node_api_get(node_api, ctx)
    assert isinstance(no_cert, OSError) or no_cert == b"", f"answered a client without a certificate: {no_cert!r}"
    ctx.load_cert_chain(pki / "node-sim-1.crt", pki / "node-sim-1.key")
    with_cert = node_api_get(node_api, ctx)
    assert isinstance(with_cert, bytes) and with_cert.startswith(b"HTTP/1.1 "), with_cert

    # The sim model, applied by the `catalog` service from deploy/catalog.yaml, answers through the gateway.
    created = podman("exec", server, "llmgw", "ctl", "keys", "create", "--name", "compose-ci").stdout
    key = re.search(r"llmgw-\S+", created).group(0)
    eventually(lambda: chat(gateway, key), 120, "sim-small answered through the gateway")

    # Prometheus scrapes the gateway, the control worker, the node worker and Temporal.
    prometheus = f"http://127.0.0.1:{stack.ports['PROMETHEUS']}"

    def targets_up():
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in active}
        assert health == {"gateway": "up", "control-worker": "up", "node-workers": "up", "temporal": "up"}, health
        return health
    eventually(targets_up, 60, "every Prometheus target up")
    # llmgw's processes export their traces to the address the file gives them.
    eventually(lambda: "otlp export /v1/traces" in podman("logs", stack.container("otel-collector")).stdout,
               30, "traces exported to otel-collector")

    # A restart of the gateway container leaves the node worker and its engine running, and serves again.
    agent = stack.container("agent-sim")
    agent_started = podman("inspect", "-f", "{{.State.StartedAt}}", agent).stdout
    engines = engine_processes(agent)
    assert engines, podman("top", agent, "pid", "args").stdout
    server_started = podman("inspect", "-f", "{{.State.StartedAt}}", server).stdout
    podman("restart", "-t", "10", server, timeout=60)
    assert podman("inspect", "-f", "{{.State.StartedAt}}", server).stdout != server_started
    stack.wait_healthy("server")
    eventually(lambda: chat(gateway, key), 60, "sim-small answered after the gateway restarted")
    assert podman("inspect", "-f", "{{.State.StartedAt}}", agent).stdout == agent_started
    assert engine_processes(agent) == engines
    print(f"\ncompose up, level by level: {'; '.join(levels)}; all healthy after {up_s:.0f} s; "
          f"the test until down: {time.monotonic() - started:.0f} s")
