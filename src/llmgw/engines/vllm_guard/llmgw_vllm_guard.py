"""An ASGI middleware that `vllm serve` loads (`--middleware llmgw_vllm_guard.KeyEveryPath`) to hold every
path to the engine key, not only `/v1`.

vLLM's own key check (`VLLM_API_KEY`) guards the paths under `/v1`, `/v2`, `/inference` and `/cohere`
(vllm/entrypoints/serve/middleware/authenticate.py, 0.32). Sleep mode's endpoints (`/sleep`, `/wake_up`,
`/is_sleeping`) exist only with `VLLM_SERVER_DEV_MODE=1`, which also opens `/collective_rpc` (a call of
any method on every worker), `/reset_prefix_cache` and `/server_info`, none of them under `/v1`. llmgw
launches a vLLM that may sleep with this module on its `PYTHONPATH` (the directory holds nothing else), so
every request without `Authorization: Bearer <VLLM_API_KEY>` is refused with 401, `/health` included, as
the sim engine does.

It runs inside vLLM's own Python (a venv of its own), so it imports nothing of llmgw's and only the
standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os


class KeyEveryPath:
    """Refuse (401) every HTTP or WebSocket request whose bearer token is not `VLLM_API_KEY`. Without a key
    in the environment it lets everything through, as vLLM does."""

    def __init__(self, app, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get("VLLM_API_KEY", "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _allowed(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if self.digest is None or scope.get("type") not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": "missing or wrong API key", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
