"""Fetching from a peer node (issue 39) against real listeners: a node's `PeerListener` over mutual TLS and
a mirror. What comes from a peer is verified by the mirror's digest, and every way a peer can fail (other
bytes, another node's certificate, not there) ends with the mirror's bytes; the listener serves no one
without a certificate from llmgw's CA. The whole path (control plane naming the peer): test_peer_fetch_e2e.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn

from llmgw.config import Settings
from llmgw.dev.procs import free_port, wait_port
from llmgw.weights.files_app import create_files_app
from llmgw.node.peer_server import PeerListener, client_context
from llmgw.security.pki import create_ca, issue_node
from llmgw.weights.fetcher import Fetcher, Peer
from llmgw.weights.manifest import record_sha256
from llmgw.weights.naming import cache_name_for


class Counting:
    """The mirror app, counting requests by (method, path)."""

    def __init__(self, app):
        self.app = app
        self.seen: dict[tuple[str, str], int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = (scope["method"], scope["path"])
            self.seen[key] = self.seen.get(key, 0) + 1
        await self.app(scope, receive, send)

    def bodies(self, path: str) -> int:
        return self.seen.get(("GET", path), 0)


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    app = Counting(create_files_app(root))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_port(port, 10)
    yield root, f"http://127.0.0.1:{port}", app
    server.should_exit = True
    t.join(5)


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    create_ca(d)
    for n in ("node-a", "node-b"):
        issue_node(d, n)
    return d


def node_settings(pki: Path, node_id: str) -> Settings:
    return Settings(state_dir=pki.parent / "state", node_id=node_id, ca_cert=pki / "ca.crt",
                    node_cert=pki / f"node-{node_id}.crt", node_key=pki / f"node-{node_id}.key", peer_port=0)


@pytest.fixture
def peer_a(tmp_path, pki):
    """node-a's peer listener over its cache, run on a thread of its own."""
    cache = tmp_path / "cache-a"
    cache.mkdir()
    listener = PeerListener(node_settings(pki, "node-a"), cache)
    listener.bind()
    t = threading.Thread(target=asyncio.run, args=(listener.run(),), daemon=True)
    t.start()
    port = int(listener.url.rsplit(":", 1)[1])
    wait_port(port, 10)
    yield cache, listener.url
    listener.stop()
    t.join(5)


def put(path: Path, data: bytes) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def fetcher_b(tmp_path, pki, url) -> Fetcher:
    ctx = client_context(node_settings(pki, "node-b"))
    return Fetcher(tmp_path / "cache-b", url, peer_tls=lambda: ctx)


async def test_a_file_comes_from_the_peer_and_the_mirror_is_asked_only_for_its_digest(tmp_path, pki, mirror, peer_a):
    root, url, app = mirror
    cache_a, peer_url = peer_a
    data = put(root / "w.bin", os.urandom(3 << 20))
    name = cache_name_for("mirror:w.bin")
    put(cache_a / name, data)
    record_sha256(cache_a, {name: hashlib.sha256(data).hexdigest()})

    got = await fetcher_b(tmp_path, pki, url).fetch("mirror:w.bin", peers=[Peer("node-a", peer_url)])
    assert Path(got.path).read_bytes() == data
    assert got.peers == ("node-a",) and got.peer_bytes == len(data)
    assert app.bodies("/files/w.bin") == 0 and app.seen.get(("HEAD", "/files/w.bin")) == 1


async def test_a_peer_serving_other_bytes_is_passed_over_for_the_mirror(tmp_path, pki, mirror, peer_a):
    """The peer's own digest is never what is checked: its record names the bytes it serves, and they are
    not the mirror's."""
    root, url, app = mirror
    cache_a, peer_url = peer_a
    data = put(root / "w.bin", os.urandom(1 << 20))
    name = cache_name_for("mirror:w.bin")
    forged = put(cache_a / name, os.urandom(len(data)))
    record_sha256(cache_a, {name: hashlib.sha256(forged).hexdigest()})

    got = await fetcher_b(tmp_path, pki, url).fetch("mirror:w.bin", peers=[Peer("node-a", peer_url)])
    assert Path(got.path).read_bytes() == data
    assert got.peers == () and app.bodies("/files/w.bin") == 1


async def test_a_peer_whose_certificate_names_another_node_is_refused(tmp_path, pki, mirror, peer_a):
    root, url, app = mirror
    cache_a, peer_url = peer_a
    data = put(root / "w.bin", os.urandom(1 << 20))
    put(cache_a / cache_name_for("mirror:w.bin"), data)

    # The control plane named node-c at that address; node-a answers there.
    got = await fetcher_b(tmp_path, pki, url).fetch("mirror:w.bin", peers=[Peer("node-c", peer_url)])
    assert Path(got.path).read_bytes() == data
    assert got.peers == () and app.bodies("/files/w.bin") == 1


async def test_a_peer_that_is_not_there_or_lacks_the_file_is_passed_over(tmp_path, pki, mirror, peer_a):
    root, url, app = mirror
    _, peer_url = peer_a  # node-a's cache is empty: 404
    data = put(root / "w.bin", os.urandom(1 << 20))
    gone = Peer("node-x", f"https://127.0.0.1:{free_port()}")
    got = await fetcher_b(tmp_path, pki, url).fetch("mirror:w.bin", peers=[gone, Peer("node-a", peer_url)])
    assert Path(got.path).read_bytes() == data and got.peers == () and app.bodies("/files/w.bin") == 1


async def test_a_version_comes_from_the_peer_with_the_mirrors_manifest(tmp_path, pki, mirror, peer_a):
    root, url, app = mirror
    cache_a, peer_url = peer_a
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(1 << 20)}
    name = cache_name_for("mirror:m/")
    for f, data in files.items():
        put(root / "m" / f, data)
        put(cache_a / name / f, data)

    got = await fetcher_b(tmp_path, pki, url).fetch("mirror:m/", peers=[Peer("node-a", peer_url)])
    assert {p.name: p.read_bytes() for p in Path(got.path).iterdir() if not p.name.startswith(".")} == files
    assert got.peers == ("node-a",)
    assert app.bodies("/files/m/") == 1  # the manifest, from the mirror
    assert all(app.bodies(f"/files/m/{f}") == 0 for f in files)


def test_the_peer_listener_serves_only_clients_with_a_certificate_from_llmgws_ca(tmp_path, pki, peer_a):
    cache_a, peer_url = peer_a
    put(cache_a / "x-w.bin", b"w")
    trust = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    trust.check_hostname = False
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(peer_url + "/files/", verify=trust, timeout=5)  # no client certificate
    other = tmp_path / "other-ca"
    create_ca(other, name="another CA")
    issue_node(other, "node-b")
    foreign = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    foreign.check_hostname = False
    foreign.load_cert_chain(str(other / "node-node-b.crt"), str(other / "node-node-b.key"))
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(peer_url + "/files/", verify=foreign, timeout=5)
    ok = client_context(node_settings(pki, "node-b"))
    listing = httpx.get(peer_url + "/files/", verify=ok, timeout=5)
    assert listing.status_code == 200 and [f["name"] for f in listing.json()["files"]] == ["x-w.bin"]
    # Hidden entries (partials, records) are not served, and a name cannot climb out of the cache.
    put(cache_a / ".partial" / "y.part", b"p")
    assert httpx.get(peer_url + "/files/.partial/y.part", verify=ok, timeout=5).status_code in (400, 404)
    assert httpx.get(peer_url + "/files/..%2F..%2Fetc%2Fpasswd", verify=ok, timeout=5).status_code in (400, 404)


def test_a_certificate_from_before_peer_fetch_advertises_no_listener(tmp_path, pki):
    """clientAuth alone (as issued before this change): a TLS client refuses it as a server's, so the
    node says nothing of a listener until it renews."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from llmgw.security import pki as pki_mod

    old = tmp_path / "old"
    create_ca(old)
    pki_mod._issue(old, "node-node-o", "node-o", ExtendedKeyUsageOID.CLIENT_AUTH, [], 7, False)
    s = Settings(state_dir=tmp_path / "s", node_id="node-o", ca_cert=old / "ca.crt", node_cert=old / "node-node-o.crt",
                 node_key=old / "node-node-o.key", peer_port=0)
    listener = PeerListener(s, tmp_path / "cache-o")
    listener.bind()
    try:
        assert listener.url and listener.advertisable() is None
        issue_node(old, "node-o", replace=True)  # renewed: both usages
        assert listener.advertisable() == listener.url
    finally:
        listener._sock.close()


def test_a_peer_port_that_is_taken_leaves_the_node_serving_no_peers_not_stopped(tmp_path, pki, peer_a, caplog):
    """The agent runs on (its engines with it): other nodes fetch from the mirror instead."""
    _, url = peer_a
    taken = int(url.rsplit(":", 1)[1])
    s = node_settings(pki, "node-b").model_copy(update={"peer_port": taken})
    listener = PeerListener(s, tmp_path / "cache-b")
    assert listener.bind() is False and listener.url is None and listener.advertisable() is None
    assert f"cannot listen on 127.0.0.1:{taken}" in caplog.text and "LLMGW_PEER_PORT" in caplog.text
