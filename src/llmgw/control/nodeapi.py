"""The node API (:8443): node workers register, heartbeat, report shard transitions, ask "still wanted?"
before a launch, and say when they leave, here.

With mutual TLS (the default in `llmgw dev` and whenever certificates are configured) the TLS handshake
proves the client holds a certificate from llmgw's CA, and every request's `node_id` must equal that
certificate's common name: a node's identity is something it proves, not something it picks. What a node
may say is checked by `FleetService` (a node speaks only for itself: 403 `node_restriction`), against the
node's own addresses: its connection's peer and its certificate's subject alternative names.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from llmgw.http.errors import APIError, install_error_handlers, json_error

from llmgw.control.fleet_service import FleetService, NodeRestricted
from llmgw.http.jsonbody import BoundedJSON
from llmgw.schemas.api import (
    HeartbeatRequest, HeartbeatResponse, LaunchCheckRequest, LaunchCheckResponse, LeaveRequest, LeaveResponse,
    RegisterRequest, RegisterResponse, ShardStatusRequest,
)
from llmgw.security.node_address import AddressUnknown, NodeAddresses

log = logging.getLogger(__name__)


def identity_error(status: int, message: str) -> APIError:
    return APIError(status, message, type="forbidden", param="node_id", code="node_identity")


def check_identity(request: Request, claimed: str, require: bool) -> None:
    """Raise an `APIError` (401/403, code `node_identity`) unless the client certificate's common name is `claimed`."""
    if not require:
        return
    tls = request.scope.get("extensions", {}).get("tls", {})
    cn = tls.get("client_cert_name")
    if cn is None:
        raise identity_error(401, "a client certificate from the llmgw CA is required (llmgw ctl cert node NODE_ID)")
    if cn != claimed:
        log.warning("refused a request claiming node %r from a certificate for %r", claimed, cn)
        raise identity_error(403, f"the client certificate is for node {cn!r}, but the request claims {claimed!r}")


def node_addresses(request: Request) -> NodeAddresses:
    """Where the request came from: the TLS connection's own peer and certificate (http/serving.py puts them in the
    scope), else the ASGI client address (plain HTTP, where nothing is proven anyway)."""
    tls = request.scope.get("extensions", {}).get("tls", {})
    if "peer_address" in tls:
        return NodeAddresses(tls["peer_address"], tuple(tls.get("client_cert_ips", ())),
                             tuple(tls.get("client_cert_names", ())))
    return NodeAddresses(request.client.host if request.client else None)


def create_node_api(fleet: FleetService, require_identity: bool):
    """The node API's ASGI app; JSON bodies are bounded before they are parsed (http/jsonbody.py)."""
    app = FastAPI(title="llmgw node API", docs_url=None, redoc_url=None, openapi_url=None)

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
        check_identity(request, req.node_id, require_identity)
        return await fleet.register(req, node_addresses(request))

    # `stop` is left out when None: a node from before it reads every answer that stops nothing.
    @app.post("/node/v1/heartbeat", response_model=HeartbeatResponse, response_model_exclude_none=True)
    async def heartbeat(req: HeartbeatRequest, request: Request) -> HeartbeatResponse:
        check_identity(request, req.node_id, require_identity)
        return await fleet.heartbeat(req)

    @app.post("/node/v1/shards")
    async def shard_status(req: ShardStatusRequest, request: Request) -> dict:
        check_identity(request, req.node_id, require_identity)
        await fleet.shard_status(req, node_addresses(request))
        return {"ok": True}

    @app.post("/node/v1/launch-check", response_model=LaunchCheckResponse)
    async def launch_check(req: LaunchCheckRequest, request: Request) -> LaunchCheckResponse:
        check_identity(request, req.node_id, require_identity)
        return await fleet.launch_check(req)

    @app.post("/node/v1/leave", response_model=LeaveResponse)
    async def leave(req: LeaveRequest, request: Request) -> LeaveResponse:
        check_identity(request, req.node_id, require_identity)
        return await fleet.leave(req)

    return BoundedJSON(app)
