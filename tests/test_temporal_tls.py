"""Every llmgw process reaches Temporal over TLS, mutual TLS or with an API key when told to (temporal.py).

A real Temporal dev server behind a TLS terminator that requires a client certificate from its CA (as a
frontend with `requireClientAuth` does): `connect` with the settings reaches it and runs a workflow call;
without the client certificate, or trusting another CA, it does not."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from temporalio.service import TLSConfig

from llmgw.config import Settings
from llmgw.security.pki import create_ca, issue_node, issue_server
from llmgw.temporal import connect, tls_config


class Terminator:
    """TLS (client certificate required, ALPN h2) on one side, plain gRPC to Temporal on the other."""

    def __init__(self, upstream: str, cert: Path, key: Path, ca: Path):
        self.upstream = upstream.rsplit(":", 1)
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.load_verify_locations(ca)
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.ctx.set_alpn_protocols(["h2"])
        self.handshakes_refused = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=self.ctx)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.upstream[0], int(self.upstream[1]))
        except OSError:
            writer.close()
            return

        async def pipe(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    async def stop(self) -> None:
        self.server.close()


@pytest.fixture
def pki(tmp_path):
    create_ca(tmp_path)
    issue_server(tmp_path, ["127.0.0.1"])
    issue_node(tmp_path, "worker-1")
    other = tmp_path / "other"
    create_ca(other)
    return tmp_path


def test_any_of_the_settings_turns_tls_on_and_half_a_client_certificate_is_refused(tmp_path, pki):
    assert tls_config(Settings(state_dir=tmp_path)) is False
    assert isinstance(tls_config(Settings(state_dir=tmp_path, temporal_api_key="k")), TLSConfig)
    assert isinstance(tls_config(Settings(state_dir=tmp_path, temporal_tls=True)), TLSConfig)
    cfg = tls_config(Settings(state_dir=tmp_path, temporal_tls_ca=pki / "ca.crt", temporal_tls_server_name="t.example"))
    assert cfg.server_root_ca_cert == (pki / "ca.crt").read_bytes() and cfg.domain == "t.example"
    with pytest.raises(SystemExit, match="needs both LLMGW_TEMPORAL_TLS_CERT and LLMGW_TEMPORAL_TLS_KEY"):
        tls_config(Settings(state_dir=tmp_path, temporal_tls_cert=pki / "node-worker-1.crt"))
    with pytest.raises(SystemExit, match="cannot read LLMGW_TEMPORAL_TLS_CA"):
        tls_config(Settings(state_dir=tmp_path, temporal_tls_ca=pki / "missing.crt"))


@pytest.mark.integration
async def test_llmgw_reaches_temporal_through_mutual_tls_and_not_without_its_certificate(temporal, namespace, tmp_path,
                                                                                        pki):
    term = Terminator(temporal.address, pki / "server.crt", pki / "server.key", pki / "ca.crt")
    address = await term.start()
    try:
        ok = Settings(state_dir=tmp_path, temporal_address=address, temporal_namespace=namespace,
                      temporal_tls_ca=pki / "ca.crt", temporal_tls_cert=pki / "node-worker-1.crt",
                      temporal_tls_key=pki / "node-worker-1.key", temporal_api_key="sent-as-a-bearer-token")
        client = await connect(ok, attempts=5)
        async for _ in client.list_workflows(page_size=1):  # a real call through the TLS hop
            break
        assert client.service_client.config.api_key == "sent-as-a-bearer-token"

        no_cert = ok.model_copy(update={"temporal_tls_cert": None, "temporal_tls_key": None})
        with pytest.raises(SystemExit, match="cannot reach Temporal"):
            await connect(no_cert, attempts=2)
        wrong_ca = ok.model_copy(update={"temporal_tls_ca": pki / "other" / "ca.crt"})
        with pytest.raises(SystemExit, match="cannot reach Temporal"):
            await connect(wrong_ca, attempts=2)
        plain = ok.model_copy(update={"temporal_tls": False, "temporal_tls_ca": None, "temporal_tls_cert": None,
                                      "temporal_tls_key": None, "temporal_api_key": None})
        with pytest.raises(SystemExit, match="cannot reach Temporal"):
            await connect(plain, attempts=2)
    finally:
        await term.stop()
