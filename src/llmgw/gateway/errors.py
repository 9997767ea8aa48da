"""The OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`, one shape for every error.

Nothing expected is ever a 500, and no body ever carries a traceback.
"""

from __future__ import annotations

import json


class APIError(Exception):
    """An error a client should see. `status` is the HTTP status; `type` the OpenAI error type."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


def loading(name: str, retry_after_s: int) -> APIError:
    return APIError(503, f"the model `{name}` is loading; retry in about {retry_after_s}s", type="service_unavailable",
                    code="model_loading", headers={"Retry-After": str(retry_after_s)})


def unavailable(name: str, why: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, f"the model `{name}` is not available: {why}", type="service_unavailable",
                    code="model_unavailable", headers={"Retry-After": str(retry_after_s)})


def upstream_failed(why: str) -> APIError:
    return APIError(502, f"the engine failed: {why}", type="upstream_error", code="engine_error")


def upstream_timeout(seconds: float) -> APIError:
    return APIError(504, f"the engine did not answer within {seconds:g}s", type="upstream_error", code="engine_timeout")
