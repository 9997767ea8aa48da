"""API keys through the real path: `llmgw ctl keys ...` → admin API → Postgres (hashed) → NOTIFY → the
gateway process. Open until the first key exists, then every /v1/ request needs a valid one; a revoked
key stops working within a moment; the official openai client works both before and after."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
from multidict import CIMultiDict
import psycopg
import pytest
from openai import AsyncOpenAI, AuthenticationError

from llmgw.dev.procs import free_port
from tests.fake_engine import FakeEngines
from tests.helpers import ControlPlane

pytestmark = pytest.mark.integration


async def ctl(cp: ControlPlane, *args: str) -> tuple[int, str, str]:
    env = {**cp.env, "LLMGW_ADMIN_URL": cp.admin}  # its state directory: the admin token ctl sends
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "llmgw", "ctl", "keys", *args, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    return p.returncode, out.decode(), err.decode()


async def status_of(cp: ControlPlane, key: str | None, path: str = "/v1/chat/completions") -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        if path == "/v1/models":
            async with s.get(cp.gateway + path, headers=headers) as r:
                body = await r.json()
        else:
            async with s.post(cp.gateway + path, headers=headers, json={
                    "model": "echo", "messages": [{"role": "user", "content": "hi"}]}) as r:
                body = await r.json()
        if r.status == 401:
            assert body["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
        return r.status


async def test_keys_required_once_created_and_revocation_is_prompt(tmp_path, database_url):
    engines = await FakeEngines().start()
    cp = ControlPlane(tmp_path, database_url, f"127.0.0.1:{free_port()}", LLMGW_ROUTE_REFRESH_S="30")
    try:
        await asyncio.to_thread(cp.start, worker=False)
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers,
                              json={"catalog": {"models": [{"name": "echo", "endpoints": [engines.url("echo")]}]}}) as r:
                assert r.status == 200
        deadline = time.monotonic() + 10
        while await status_of(cp, None) != 200:  # no key exists yet: open, as `llmgw dev` needs
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        client = AsyncOpenAI(base_url=cp.gateway + "/v1", api_key="anything")
        assert (await client.models.list()).data[0].id == "echo"

        code, key, err = await ctl(cp, "create", "--name", "ci")
        assert code == 0, err
        key = key.strip()
        assert key.startswith("llmgw-") and len(key) > 40
        with psycopg.connect(database_url) as conn:  # only a hash is stored
            stored = conn.execute("SELECT key_hash, prefix FROM api_keys").fetchall()
        assert len(stored) == 1 and key not in stored[0][0] and key.startswith(stored[0][1])

        # The refresh timer is 30 s here: only the change notification can make these prompt.
        t0 = time.monotonic()
        while await status_of(cp, None) != 401:
            assert time.monotonic() - t0 < 2, "the new key was not required within 2s"
            await asyncio.sleep(0.05)
        assert await status_of(cp, None, "/v1/models") == 401
        assert await status_of(cp, "llmgw-not-a-key") == 401
        async with aiohttp.ClientSession() as s:  # the 401 says which: no key, or one it does not know
            for sent, says in ((None, "a valid API key is required"), ("llmgw-not-a-key", "the API key sent is not valid")):
                async with s.post(cp.gateway + "/v1/chat/completions", json={"model": "echo", "messages": []},
                                  headers={"Authorization": f"Bearer {sent}"} if sent else {}) as r:
                    assert r.status == 401 and says in (await r.json())["error"]["message"], await r.text()
        assert await status_of(cp, key) == 200
        assert await status_of(cp, key, "/v1/models") == 200
        async with aiohttp.ClientSession() as s:  # two Authorization headers: which is meant cannot be told
            hdrs = CIMultiDict([("Authorization", f"Bearer {key}"), ("Authorization", "Bearer someone-else")])
            async with s.get(cp.gateway + "/v1/models", headers=hdrs) as r:
                assert r.status == 401, await r.text()
        with pytest.raises(AuthenticationError):
            await AsyncOpenAI(base_url=cp.gateway + "/v1", api_key="wrong").models.list()
        r = await AsyncOpenAI(base_url=cp.gateway + "/v1", api_key=key).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}])
        assert r.choices[0].message.content == "echo: x"
        async with aiohttp.ClientSession() as s:  # health and metrics stay open for probes and scrapers
            for path in ("/healthz", "/metrics"):
                async with s.get(cp.gateway + path) as r:
                    assert r.status == 200

            async def refused() -> float:
                async with s.get(cp.gateway + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("llmgw_requests_total{") and 'status="401"' in line:
                            assert 'model="unknown"' in line  # never a name the client chose
                            return float(line.rsplit(" ", 1)[1])
                return 0.0

            before = await refused()  # 401s are in llmgw_requests_total, so an operator sees them
            for k in (None, "llmgw-not-a-key", "wrong"):
                assert await status_of(cp, k) == 401
            assert await refused() - before == 3

        code, listing, _ = await ctl(cp, "list")
        header, row = listing.splitlines()[:2]
        key_id = row.split()[0]
        assert header.split()[:2] == ["ID", "PREFIX"] and "AGE" in header
        assert code == 0 and "ci" in row and "active" in row and key not in listing
        code, _, err = await ctl(cp, "revoke", "ci", "--yes")  # its name: told its id, nothing revoked
        assert code != 0 and f"`llmgw ctl keys revoke {key_id}`" in err, err
        assert await status_of(cp, key) == 200
        code, _, _ = await ctl(cp, "revoke", key_id, "--yes")
        assert code == 0
        t0 = time.monotonic()
        while await status_of(cp, key) != 401:
            assert time.monotonic() - t0 < 2, "the revoked key still worked after 2s"
            await asyncio.sleep(0.05)
        assert await status_of(cp, None) == 401  # revoking the last key does not open the gateway
        code, listing, _ = await ctl(cp, "list")
        assert "revoked" in listing
        code, _, err = await ctl(cp, "revoke", "no-such-id", "--yes")
        assert code != 0 and "no API key" in err
    finally:
        await asyncio.to_thread(cp.stop)
        await engines.close()
