"""The one error module's answer when the database is away (issue 38): a connection refused or lost in the
middle of a transaction is a 503 that says so, with Retry-After, never a 500; other database errors stay
unexpected (500)."""

from __future__ import annotations

import psycopg
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import IntegrityError, OperationalError

from llmgw.http.errors import install_error_handlers


def _client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app, "the admin API")

    @app.post("/lost")
    async def lost():
        raise OperationalError("COMMIT", {}, psycopg.OperationalError("server closed the connection unexpectedly"))

    @app.post("/duplicate")
    async def duplicate():
        raise IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate key"))
    return TestClient(app, raise_server_exceptions=False)


def test_a_lost_database_connection_is_a_503_with_retry_after():
    r = _client().post("/lost")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    err = r.json()["error"]
    assert err["code"] == "database_unavailable" and err["type"] == "service_unavailable"
    assert "may not have been saved" in err["message"] and "server closed" not in err["message"]


def test_another_database_error_is_still_a_500():
    r = _client().post("/duplicate")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
