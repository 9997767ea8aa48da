"""The node API (:8443): node workers register, heartbeat, report shard transitions, ask "still wanted?"
before a launch, and say when they leave, here.

With mutual TLS (the default in `llmgw dev` and whenever certificates are configured) the TLS handshake
proves the client holds a certificate from llmgw's CA, and every request's `node_id` must equal that
certificate's common name: a node's identity is something it proves, not something it picks. What a node
may say is checked by `FleetService` (a node speaks only for itself: 403 `node_restriction`), against the
node's own addresses: its connection's peer and its certificate's subject alternative names.

Issue 36: the node API does not listen beyond loopback without mutual TLS (`listen_refusal`), unless the
operator writes the risk out (`LLMGW_NODE_API_INSECURE=anyone-can-claim-any-node`). A certificate on the
deny-list is refused on every request (403 `certificate_revoked`, control/revocations.py), and a node
renews its short-lived certificate here before it runs out (`POST /node/v1/renew`, a CSR for a key the node
made: the new certificate names the same node and addresses as the one it is asked over).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request

from llmgw.config import Settings
from llmgw.http.errors import APIError, install_error_handlers, json_error

from llmgw.control import heartbeat_path
from llmgw.control.fleet_service import FleetService, NodeRestricted
from llmgw.control.heartbeat_batch import HeartbeatBatcher
from llmgw.control.heartbeat_path import HeartbeatPath
from llmgw.control.revocations import DenyList, DenyListUnknown
from llmgw.http.jsonbody import BoundedJSON
from llmgw.version import from_user_agent
from llmgw.schemas.api import (
    HeartbeatRequest, HeartbeatResponse, LaunchCheckRequest, LaunchCheckResponse, LeaveRequest, LeaveResponse,
    RegisterRequest, RegisterResponse, RenewRequest, RenewResponse, ShardStatusRequest,
)
from llmgw.security.admin_token import loopback_only
from llmgw.security.node_address import AddressUnknown, NodeAddresses
from llmgw.security.pki import CSRRefused, cert_pem, serial_text, sign_node_csr

log = logging.getLogger(__name__)

# The one value of LLMGW_NODE_API_INSECURE that lets the node API listen beyond loopback without mTLS.
NODE_API_INSECURE = "anyone-can-claim-any-node"


def listen_refusal(settings: Settings) -> str | None:
    """Why the node API must not start with `settings`, or None: beyond loopback it needs mutual TLS (else
    any client that reaches it can claim to be any node: mark its replicas lost, or report a forged Ready
    engine that is then sent client prompts), unless `node_api_insecure` is `NODE_API_INSECURE`."""
    if settings.node_api_tls or loopback_only(settings.host) or settings.node_api_insecure == NODE_API_INSECURE:
        return None
    wrong = (f"LLMGW_NODE_API_INSECURE={settings.node_api_insecure!r} is not the value that accepts the risk. "
             if settings.node_api_insecure else "")
    return (f"{wrong}the node API would listen on {settings.host}:{settings.node_api_port} without mutual TLS: any "
            "client that reaches it could claim to be any node (mark its replicas lost, or report a forged engine "
            "that then receives client prompts). Set LLMGW_CA_CERT, LLMGW_NODE_API_CERT and LLMGW_NODE_API_KEY "
            "(llmgw ctl cert ca; llmgw ctl cert server --host ADDR), or listen on loopback only "
            f"(LLMGW_HOST=127.0.0.1), or accept the risk with LLMGW_NODE_API_INSECURE={NODE_API_INSECURE}")


def identity_error(status: int, message: str) -> APIError:
    return APIError(status, message, type="forbidden", param="node_id", code="node_identity")


@dataclass(frozen=True)
class Peer:
    """The verified client certificate of a request: its node id, serial (lower-case hex) and notBefore."""

    node_id: str
    serial: str
    not_before: dt.datetime


@functools.lru_cache(maxsize=16384)
def _cert_time(text: str) -> dt.datetime:
    """A certificate's `notBefore` as `getpeercert()` writes it, parsed once per distinct text (strptime was
    a twentieth of a heartbeat's CPU; a fleet's certificates have a few thousand distinct ones)."""
    return dt.datetime.fromtimestamp(ssl.cert_time_to_seconds(text), dt.timezone.utc)


def _peer(scope: dict) -> Peer | None:
    tls = scope.get("extensions", {}).get("tls", {})
    cn = tls.get("client_cert_name")
    if cn is None:
        return None
    try:
        return Peer(cn, serial_text(tls["client_cert_serial"]), _cert_time(tls["client_cert_not_before"]))
    except (KeyError, TypeError, ValueError):
        raise identity_error(401, "the client certificate's serial or validity cannot be read") from None


def check_identity(scope: dict, claimed: str, require: bool, deny: DenyList | None = None) -> Peer | None:
    """Raise an `APIError` unless the client certificate of the request (its ASGI `scope`) has the common
    name `claimed` (401/403, code `node_identity`) and is not on the deny-list `deny` (403
    `certificate_revoked`; 503 `revocations_unknown` until the list has been read). Returns the certificate
    (None without `require`)."""
    if not require:
        return None
    peer = _peer(scope)
    if peer is None:
        raise identity_error(401, "a client certificate from the llmgw CA is required (llmgw ctl cert node NODE_ID)")
    if deny is not None:
        try:
            revoked = deny.refusal(peer.node_id, peer.serial, peer.not_before)
        except DenyListUnknown as exc:
            raise APIError(503, f"{exc}; try again shortly", type="service_unavailable", code="revocations_unknown",
                           headers={"Retry-After": "2"}) from None
        if revoked is not None:
            log.warning("refused a request from node %s: %s", peer.node_id, revoked)
            raise APIError(403, str(revoked), type="forbidden", param=None, code="certificate_revoked")
    if peer.node_id != claimed:
        log.warning("refused a request claiming node %r from a certificate for %r", claimed, peer.node_id)
        raise identity_error(403, f"the client certificate is for node {peer.node_id!r}, but the request claims {claimed!r}")
    return peer


@dataclass(frozen=True)
class Renewer:
    """What signs renewed node certificates: the CA's certificate and key, and their lifetime (days)."""

    ca_cert: Path
    ca_key: Path
    days: float


def node_addresses(request: Request) -> NodeAddresses:
    """Where the request came from: the TLS connection's own peer and certificate (http/serving.py puts them in the
    scope), else the ASGI client address (plain HTTP, where nothing is proven anyway)."""
    tls = request.scope.get("extensions", {}).get("tls", {})
    if "peer_address" in tls:
        return NodeAddresses(tls["peer_address"], tuple(tls.get("client_cert_ips", ())),
                             tuple(tls.get("client_cert_names", ())))
    return NodeAddresses(request.client.host if request.client else None)


def create_node_api(fleet: FleetService, require_identity: bool, deny: DenyList | None = None,
                    renewer: Renewer | None = None):
    """The node API's ASGI app; JSON bodies are bounded before they are parsed (http/jsonbody.py). With
    `require_identity` (mutual TLS), every request's certificate must name the node it claims and not be on
    `deny`; `renewer` signs renewals (None: `POST /node/v1/renew` answers 503 saying what to set)."""
    app = FastAPI(title="llmgw node API", docs_url=None, redoc_url=None, openapi_url=None)

    def identify(request: Request, claimed: str) -> Peer | None:
        return check_identity(request.scope, claimed, require_identity, deny)

    install_error_handlers(app, "the node API")

    @app.exception_handler(NodeRestricted)
    async def _restricted(request: Request, exc: NodeRestricted):
        return json_error(APIError(403, f"a node may only report on its own shards: {exc}", type="forbidden",
                                   param="shard", code="node_restriction"))

    @app.exception_handler(AddressUnknown)
    async def _unknown(request: Request, exc: AddressUnknown):  # not a refusal: the node asks again
        return json_error(APIError(503, f"{exc}; try again shortly", type="service_unavailable", param="shard",
                                   code="address_unknown", headers={"Retry-After": "2"}))

    @app.post("/node/v1/register", response_model=RegisterResponse)
    async def register(req: RegisterRequest, request: Request) -> RegisterResponse:
        identify(request, req.node_id)
        return await fleet.register(req, node_addresses(request), from_user_agent(request.headers.get("user-agent")))

    # `stop` is left out when None: a node from before it reads every answer that stops nothing.
    @app.post("/node/v1/heartbeat", response_model=HeartbeatResponse, response_model_exclude_none=True)
    async def heartbeat(req: HeartbeatRequest, request: Request) -> HeartbeatResponse:
        identify(request, req.node_id)
        return await fleet.heartbeat(req, node_addresses(request) if req.inventory is not None else None)

    @app.post("/node/v1/shards")
    async def shard_status(req: ShardStatusRequest, request: Request) -> dict:
        identify(request, req.node_id)
        await fleet.shard_status(req, node_addresses(request))
        return {"ok": True}

    # `peers` is left out when None, as it was before peer fetch.
    @app.post("/node/v1/launch-check", response_model=LaunchCheckResponse, response_model_exclude_none=True)
    async def launch_check(req: LaunchCheckRequest, request: Request) -> LaunchCheckResponse:
        identify(request, req.node_id)
        return await fleet.launch_check(req)

    @app.post("/node/v1/leave", response_model=LeaveResponse)
    async def leave(req: LeaveRequest, request: Request) -> LeaveResponse:
        identify(request, req.node_id)
        return await fleet.leave(req)

    @app.post("/node/v1/renew", response_model=RenewResponse)
    async def renew(req: RenewRequest, request: Request) -> RenewResponse:
        """A new certificate for the node the current one names, over the CSR's key (security/pki.py)."""
        if not require_identity:
            raise APIError(400, "certificates are renewed only over mutual TLS; this node API runs without it",
                           param=None, code="mtls_required")
        if deny is not None:  # read now, not as of the last refresh: a node revoked a moment ago gets no new one
            try:
                await deny.load()
            except Exception as exc:  # noqa: BLE001 - Postgres away: no renewal without the current list
                log.warning("renewal for node %s deferred: the deny-list cannot be read (%s)", req.node_id, exc)
                raise APIError(503, "the deny-list of node certificates cannot be read now; try again shortly",
                               type="service_unavailable", code="revocations_unknown",
                               headers={"Retry-After": "5"}) from None
        peer = identify(request, req.node_id)
        assert peer is not None
        if renewer is None:
            raise APIError(503, "this node API has no CA key to sign renewals with: set LLMGW_CA_KEY (or keep "
                           "ca.key beside LLMGW_CA_CERT) on the control plane", type="service_unavailable",
                           code="renewal_unavailable", headers={"Retry-After": "60"})
        tls = request.scope["extensions"]["tls"]
        try:
            cert = sign_node_csr(renewer.ca_cert, renewer.ca_key, req.csr, peer.node_id,
                                 list(tls.get("client_cert_ips", ())), list(tls.get("client_cert_names", ())),
                                 renewer.days)
        except CSRRefused as exc:
            raise APIError(400, str(exc), param="csr", code="invalid_csr") from None
        except (OSError, ValueError) as exc:  # the CA's files: unreadable, not a key, a key with a passphrase
            log.error("cannot sign node %s's renewal with %s and %s: %s", peer.node_id, renewer.ca_cert,
                      renewer.ca_key, exc)
            raise APIError(503, "this node API cannot read its CA certificate and key to sign renewals; its log "
                           "says why", type="service_unavailable", code="renewal_unavailable",
                           headers={"Retry-After": "60"}) from None
        serial = serial_text(cert.serial_number)
        log.info("renewed the certificate of node %s: serial %s replaces %s, valid until %s", peer.node_id, serial,
                 peer.serial, cert.not_valid_after_utc.isoformat(timespec="seconds"))
        return RenewResponse(certificate=cert_pem(cert), serial=serial,
                             not_after=cert.not_valid_after_utc)

    # The steady-state heartbeat is served before FastAPI, in batches; every other request, and any heartbeat
    # it does not serve itself, by the route above (control/heartbeat_path.py).
    lean = HeartbeatPath(HeartbeatBatcher(fleet), lambda scope, claimed: check_identity(scope, claimed,
                                                                                      require_identity, deny))
    return BoundedJSON(app, lean={heartbeat_path.PATH: lean})
