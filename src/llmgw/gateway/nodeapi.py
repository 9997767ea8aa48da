"""The node API (:8443): node workers register, heartbeat and report shard transitions here."""

from __future__ import annotations

from fastapi import FastAPI

from llmgw.gateway.fleet_service import FleetService
from llmgw.schemas.api import HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse, ShardStatusRequest


def create_node_api(fleet: FleetService) -> FastAPI:
    app = FastAPI(title="llmgw node API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/node/v1/register", response_model=RegisterResponse)
    async def register(req: RegisterRequest) -> RegisterResponse:
        return await fleet.register(req)

    @app.post("/node/v1/heartbeat", response_model=HeartbeatResponse)
    async def heartbeat(req: HeartbeatRequest) -> HeartbeatResponse:
        return await fleet.heartbeat(req)

    @app.post("/node/v1/shards")
    async def shard_status(req: ShardStatusRequest) -> dict:
        await fleet.shard_status(req)
        return {"ok": True}

    return app
