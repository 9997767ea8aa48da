"""`llmgw mirror add` as a durable workflow, through the real path: the `llmgw mirror add/list/cancel` CLI,
Temporal, the mirror worker in `llmgw mirror serve`, and an origin HTTP server (tests/origin_server.py)
that serves repository layouts, drops connections and is killed and restarted. What a node then fetches
from the mirror is checked by the node's own fetcher."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.dev.procs import free_port, wait_port
from llmgw.weights.fetcher import Fetcher
from llmgw.mirror.staging import STAGING
from tests.helpers import REPO, Proc, wait_until

pytestmark = pytest.mark.integration
MiB = 1 << 20


def safetensors(size: int, seed: str) -> bytes:
    """A valid safetensors file of about `size` bytes: one U8 tensor."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    data = (hashlib.sha256(seed.encode()).digest() * (size // 32 + 1))[:size]
    return struct.pack("<Q", len(header)) + header + data


def layout(root: Path, shards: int, shard_size: int) -> dict[str, bytes]:
    """A safetensors repository layout as Hugging Face has it, plus files a replica does not need."""
    files: dict[str, bytes] = {}
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    for i, n in enumerate(names):
        files[n] = safetensors(shard_size, n)
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {f"layer{i}.w": n for i, n in enumerate(names)}}).encode()
    files["config.json"] = b'{"architectures": ["LlamaForCausalLM"]}'
    files["tokenizer.json"] = b'{"version": "1.0"}'
    files["generation_config.json"] = b'{"temperature": 0.7}'
    root.mkdir(parents=True, exist_ok=True)
    for n, data in files.items():
        (root / n).write_bytes(data)
    (root / "README.md").write_text("not needed")  # on the origin, not wanted by a replica
    (root / "pytorch_model.bin").write_bytes(b"old format, not wanted")
    return files


class OriginProcess:
    """The origin as a process, so it can be killed mid-transfer and started again on its port."""

    def __init__(self, root: Path, log_dir: Path, host: str = "127.0.0.1"):
        self.root = root
        self.host = host
        self.port = free_port(host)
        self.log_file = log_dir / "origin.jsonl"
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, **config) -> "OriginProcess":
        cfg = {"log_file": str(self.log_file), "host": self.host, **config}
        with open(self.log_dir / "origin.out", "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.origin_server", str(self.root), str(self.port),
                                          json.dumps(cfg)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait(self.host, self.port, self.proc)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def log(self, path: str | None = None) -> list[dict]:
        if not self.log_file.exists():
            return []
        rows = [json.loads(line) for line in self.log_file.read_text().splitlines() if line.strip()]
        return [r for r in rows if path is None or r["path"] == path]


def _wait(host: str, port: int, proc: subprocess.Popen) -> None:
    import socket

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection((host, port), 0.3).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port}")


class Mirror:
    """`llmgw mirror serve` (listener + mirror worker) and the `llmgw mirror` CLI, on one Temporal namespace."""

    def __init__(self, tmp: Path, temporal_address: str, namespace: str, private: str):
        self.tmp = tmp
        self.port = free_port()
        self.dir = tmp / "state" / "mirror"
        self.env = {**os.environ, "LLMGW_STATE_DIR": str(tmp / "state"), "LLMGW_TEMPORAL_ADDRESS": temporal_address,
                    "LLMGW_TEMPORAL_NAMESPACE": namespace, "LLMGW_MIRROR_PORT": str(self.port),
                    "LLMGW_MIRROR_PRIVATE_SOURCES": private, "LLMGW_MIRROR_HEARTBEAT_TIMEOUT_S": "4",
                    "LLMGW_MIRROR_PROGRESS_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []
        self.serving: Proc | None = None
        self.namespace = namespace
        self.temporal_address = temporal_address

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> Proc:
        p = Proc(f"mirror-{len(self.procs)}", ["mirror", "serve"], self.env, self.tmp / "logs")
        self.procs.append(p)
        wait_port(self.port, 30, p.proc, "mirror")
        self.serving = p
        return p

    def cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmgw", "mirror", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)

    def cli_bg(self, *args: str) -> tuple[subprocess.Popen, Path]:
        """The CLI in the background (its own session, like a terminal); returns it and its output file."""
        path = self.tmp / "logs" / f"cli-{time.monotonic_ns()}.out"
        with open(path, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "llmgw", "mirror", *args], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return proc, path

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
                   or line.startswith(name + " "))

    def logs(self) -> str:
        return "\n".join(f"---- {p.name}\n{p.log()[-4000:]}" for p in self.procs)

    def staged(self) -> list[Path]:
        """Files staged for versions not published (the mirror-wide publish lock aside)."""
        return [p for p in (self.dir / STAGING).glob("*/*") if p.is_file()]

    async def client(self) -> Client:
        return await Client.connect(self.temporal_address, namespace=self.namespace,
                                    data_converter=pydantic_data_converter)

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.stop()


@pytest.fixture
def mirror_for(tmp_path, temporal, namespace):
    made: list[Mirror] = []

    def make(private: str = "127.0.0.1/32") -> Mirror:
        m = Mirror(tmp_path, temporal.address, namespace, private)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture
def origin_proc(tmp_path):
    started: list[OriginProcess] = []

    def make(root: Path, host: str = "127.0.0.1") -> OriginProcess:
        (tmp_path / "logs").mkdir(exist_ok=True)
        o = OriginProcess(root, tmp_path / "logs", host)
        started.append(o)
        return o

    yield make
    for o in started:
        o.kill()


def history_activities(events: list, kind: str) -> int:
    return sum(1 for e in events if e.HasField("activity_task_scheduled_event_attributes")
               and e.activity_task_scheduled_event_attributes.activity_type.name == kind)


async def test_a_three_shard_layout_survives_killing_the_worker_the_cli_and_the_origin(tmp_path, mirror_for, origin_proc):
    """The issue's "done when": `mirror add` of a three-shard safetensors layout from a local server, the
    CLI and the mirror worker killed mid-download and the origin dropping a connection and restarted: one
    workflow, every file resumed rather than fetched again, published once, and a node's fetch of the
    published version verifies every sha256."""
    files = layout(tmp_path / "origin" / "org" / "Model-3B", shards=3, shard_size=6 * MiB)
    origin = origin_proc(tmp_path / "origin").start(rate=1_500_000, drop={"/org/Model-3B/model-00002-of-00003.safetensors": 2 * MiB})
    mirror = mirror_for()
    mirror.serve()
    source = f"{origin.url}/org/Model-3B/"

    first, _ = mirror.cli_bg("add", source)
    wait_until(lambda: mirror.metric("llmgw_mirror_download_bytes") > 3 * MiB, timeout_s=60,
               what="the download under way", why=mirror.logs)
    # Not ready yet: a node asking now gets 409, never a partial manifest.
    r = httpx.get(mirror.url + "/files/Model-3B/", timeout=5)
    assert r.status_code == 409 and "not ready yet" in r.json()["error"]

    os.killpg(first.pid, signal.SIGKILL)  # the operator's terminal goes away ...
    first.wait(5)
    mirror.serving.kill()  # ... and the mirror worker dies mid-download
    origin.kill()  # the origin too
    partial_sizes = {p.name: p.stat().st_size for p in mirror.staged() if p.name.endswith(".part")}
    assert partial_sizes and all(s > 0 for s in partial_sizes.values()), partial_sizes
    origin.start(rate=3_000_000)
    mirror.serve()

    # A second operator mirrors the same source: the same workflow is found and followed to the end.
    second = mirror.cli("add", source, timeout_s=180)
    assert second.returncode == 0, second.stdout + second.stderr + mirror.logs()
    assert "published" in second.stdout and "source: mirror:Model-3B/" in second.stdout, second.stdout

    # What a node gets: the manifest (exactly the set a replica needs) and every file, sha256-verified.
    manifest = httpx.get(mirror.url + "/files/Model-3B/", timeout=10).json()
    assert sorted(f["name"] for f in manifest["files"]) == sorted(files)
    assert all(f["sha256"] == hashlib.sha256(files[f["name"]]).hexdigest() for f in manifest["files"])
    got = await Fetcher(tmp_path / "node-cache", mirror.url).fetch("mirror:Model-3B/")
    assert {p.name: p.read_bytes() for p in Path(got.path).iterdir()} == files
    assert not mirror.staged()

    # One workflow run, every shard resumed from where it was (ranged requests after the restart), and
    # published once.
    client = await mirror.client()
    runs = [wf async for wf in client.list_workflows('WorkflowType = "MirrorWorkflow"')]
    assert len(runs) == 1, runs
    events = [e async for e in client.get_workflow_handle(runs[0].id).fetch_history_events()]
    assert history_activities(events, "publish_mirror_version") == 1
    for name, size in partial_sizes.items():
        shard = name.split(".safetensors")[0] + ".safetensors"
        resumed = [e for e in origin.log(f"/org/Model-3B/{shard}") if e["range"] and e["range"] != "bytes=0-0"]
        assert resumed and resumed[0]["start"] >= size - MiB, (shard, size, resumed)
        served = sum(e["sent"] for e in origin.log(f"/org/Model-3B/{shard}") if e["range"] != "bytes=0-0")
        assert served <= len(files[shard]) + 4 * MiB, (shard, served)  # not fetched twice

    listing = mirror.cli("list")
    assert "Model-3B" in listing.stdout and "published" in listing.stdout and "mirror:Model-3B/" in listing.stdout


def gguf(size: int, seed: str) -> bytes:
    return b"GGUF" + (hashlib.sha256(seed.encode()).digest() * (size // 32 + 1))[:size - 4]


async def test_sources_that_cannot_be_mirrored_fail_with_the_reason_and_leave_nothing(tmp_path, mirror_for, origin_proc):
    """Refused as a web page (saying what to write), a split GGUF with a part missing (named), an origin
    address in another spelling of loopback, a file that disappears mid-download: each fails with its
    reason in `mirror add` and `mirror list`, and leaves no staged file. A signed token in a source is
    never shown, in the CLI, the listing or the mirror's log."""
    from tests.origin_server import Origin

    root = tmp_path / "origin"
    root.mkdir()
    (root / "big-00001-of-00003.gguf").write_bytes(gguf(1000, "1"))
    (root / "big-00003-of-00003.gguf").write_bytes(gguf(1000, "3"))
    (root / "flaky.gguf").write_bytes(gguf(3 * MiB, "flaky"))
    (root / "saved.bin").write_bytes(b"<!doctype html><html>" + b" " * 4000)  # a web page saved as a file
    origin = origin_proc(root, host="127.0.0.2").start(html=["/org/page"], drop={"/flaky.gguf": MiB},
                                                       gone_after_drop=["/flaky.gguf"])
    elsewhere = Origin(root, free_port())  # the same files on 127.0.0.1, which this mirror may not fetch from
    mirror = mirror_for(private="127.0.0.2/32")
    mirror.serve()
    try:
        page = mirror.cli("add", "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct")
        assert page.returncode == 2
        assert "write https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/resolve/main/" in page.stderr, page.stderr

        html = mirror.cli("add", f"{origin.url}/org/page", "--name", "page")
        assert html.returncode == 1 and "web page" in html.stdout, html.stdout + html.stderr

        split = mirror.cli("add", f"{origin.url}/big-00001-of-00003.gguf")
        assert split.returncode == 1 and "big-00002-of-00003.gguf" in split.stdout and "missing" in split.stdout, \
            split.stdout

        for host in ("127.1", "2130706433"):
            loop = mirror.cli("add", f"http://{host}:{elsewhere.port}/big-00001-of-00003.gguf", "--name", f"l{host}")
            assert loop.returncode == 1 and "loopback" in loop.stdout and "LLMGW_MIRROR_PRIVATE_SOURCES" in loop.stdout, \
                loop.stdout + loop.stderr
        assert elsewhere.log() == []  # never connected to

        secret = "X-Amz-Signature=SECRET0123456789"
        missing = mirror.cli("add", f"{origin.url}/nothing.gguf?{secret}")
        assert missing.returncode == 1 and "404" in missing.stdout, missing.stdout

        flaky = mirror.cli("add", f"{origin.url}/flaky.gguf")
        assert flaky.returncode == 1 and "no such file" in flaky.stdout, flaky.stdout + mirror.logs()

        # A file published as .gguf must be one: refused here, not minutes later by llama-server on a node.
        named = mirror.cli("add", f"{origin.url}/saved.bin", "--name", "model.gguf")
        assert named.returncode == 1 and "model.gguf is not a GGUF file" in named.stdout, named.stdout + mirror.logs()
        assert "begins with '<!doctype html><'" in named.stdout and "/resolve/" in named.stdout, named.stdout
        local = mirror.cli("add", str(root / "saved.bin"), "--name", "local.gguf")
        assert local.returncode == 2 and "local.gguf is not a GGUF file" in local.stderr, local.stdout + local.stderr
    finally:
        elsewhere.stop()

    assert not mirror.staged()  # nothing left behind by any of them
    assert not [p for p in mirror.dir.rglob("*") if p.is_file() and ".staging" not in p.parts]  # nothing published
    listing = mirror.cli("list")
    assert listing.stdout.count("failed") >= 5, listing.stdout
    assert "big-00002-of-00003.gguf" in listing.stdout and "web page" in listing.stdout
    everything = "".join(r.stdout + r.stderr for r in (missing, listing)) + mirror.logs()
    assert "SECRET0123456789" not in everything
    assert "nothing.gguf?<redacted>" in missing.stdout


async def test_two_operators_one_download_then_cancel_and_a_single_file(tmp_path, mirror_for, origin_proc):
    """The same source added twice is one workflow and one download; `mirror list` shows it downloading
    with its progress; `mirror cancel` stops it and removes what it staged. A single GGUF is published as
    a file that a node fetches and verifies against the mirror's sha256."""
    files = layout(tmp_path / "origin" / "slow", shards=2, shard_size=4 * MiB)
    (tmp_path / "origin" / "one.gguf").write_bytes(gguf(256 << 10, "one"))
    origin = origin_proc(tmp_path / "origin").start(rate=150_000)
    mirror = mirror_for()
    mirror.serve()
    empty = mirror.cli("list").stdout  # nothing downloaded yet: it says where copied-in files are listed
    assert "no versions downloaded with `llmgw mirror add URL` yet" in empty and "/files lists them" in empty, empty
    source = f"{origin.url}/slow/"
    a = mirror.cli("add", source, "--detach")
    assert a.returncode == 0, a.stdout + a.stderr
    follower, out = mirror.cli_bg("add", source)  # a second operator, following the same download
    wait_until(lambda: "downloading" in out.read_text(), timeout_s=60, what="the follower's progress",
               why=lambda: out.read_text() + mirror.logs())
    follower.send_signal(signal.SIGINT)  # Ctrl-C: detach, do not cancel
    assert follower.wait(20) == 0
    text = out.read_text()
    assert text.splitlines()[0] == a.stdout.splitlines()[0]  # the same workflow id
    assert "detached" in text and "mirror cancel slow" in text, text
    wait_until(lambda: "downloading" in (listing := mirror.cli("list").stdout) and "MiB of" in listing,
               timeout_s=60, what="list showing progress", why=mirror.logs)
    assert len([1 for line in mirror.cli("list").stdout.splitlines() if line.startswith("slow ")]) == 1
    # Where the Temporal UI looks: the workflow's memo (and the mirror's metrics).
    client = await mirror.client()
    wid = a.stdout.split("as workflow ")[1].split()[0]
    memo = await (await client.get_workflow_handle(wid).describe()).memo_value("progress")
    assert memo["state"] == "downloading" and memo["total"] > 8 * MiB, memo
    assert mirror.metric("llmgw_mirror_download_size_bytes") > 0

    cancel = mirror.cli("cancel", "slow")
    assert cancel.returncode == 0 and "canceled" in cancel.stdout, cancel.stdout + cancel.stderr + mirror.logs()
    wait_until(lambda: not mirror.staged(), timeout_s=20, what="staging removed")
    assert not (mirror.dir / "slow").exists()
    assert "canceled" in mirror.cli("list").stdout
    for name in files:
        if name.endswith(".safetensors"):
            gets = [e for e in origin.log(f"/slow/{name}") if e["range"] != "bytes=0-0"]
            assert len(gets) <= 1, gets  # one download for both operators (the one canceled in flight)
    assert mirror.cli("cancel", "slow").returncode == 1  # nothing left to cancel

    one = mirror.cli("add", f"{origin.url}/one.gguf")
    assert one.returncode == 0 and "source: mirror:one.gguf" in one.stdout, one.stdout + one.stderr
    got = await Fetcher(tmp_path / "node-cache", mirror.url).fetch("mirror:one.gguf")
    assert Path(got.path).read_bytes() == (tmp_path / "origin" / "one.gguf").read_bytes()
    again = mirror.cli("add", f"{origin.url}/one.gguf")  # a second run finds it published: nothing fetched
    assert again.returncode == 0 and "source: mirror:one.gguf" in again.stdout
    other = mirror.cli("add", f"{origin.url}/slow/config.json", "--name", "one.gguf")  # the name is taken
    assert other.returncode == 1 and "never changes" in other.stdout, other.stdout
    assert len([e for e in origin.log("/one.gguf") if e["range"] != "bytes=0-0"]) == 1
