"""The admin API's guard through a real `llmgw server` (control/admin_guard.py, security/admin_token.py):
Host must be an address or localhost, cross-site requests are refused, changes come only as JSON, the
bearer token is required beyond loopback (and `llmgw ctl` sends it), and bodies are bounded like the
gateway's. Also: docker-compose.yml never publishes the admin API without its token."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import httpx
import pytest
import yaml

from llmgw.dev.procs import free_port
from llmgw.security.admin_token import loopback_only
from tests.helpers import REPO, ControlPlane

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def cp(tmp_path_factory, module_database_url):
    plane = ControlPlane(tmp_path_factory.mktemp("admin"), module_database_url, f"127.0.0.1:{free_port()}")
    try:
        await asyncio.to_thread(plane.start, worker=False)
        yield plane
    finally:
        await asyncio.to_thread(plane.stop)


def get(cp: ControlPlane, **headers: str) -> httpx.Response:
    """GET /admin/v1/models with the admin token and `headers` (an `authorization` given replaces the token)."""
    return httpx.get(cp.admin + "/admin/v1/models", headers={**cp.admin_headers, **headers}, timeout=10)


def test_host_must_be_an_ip_address_or_localhost(cp):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    assert get(cp).status_code == 200
    assert get(cp, host=f"localhost:{cp.ports['admin']}").status_code == 200
    for host in ("evil.example", f"evil.example:{cp.ports['admin']}", "127.0.0.1.evil.example"):
        r = get(cp, host=host)
        assert r.status_code == 403, host
        assert "Host" in r.json()["error"]["message"]


def test_cross_site_requests_are_refused(cp):
    same = f"http://127.0.0.1:{cp.ports['admin']}"
    assert get(cp, origin=same).status_code == 200
    for headers in ({"origin": "http://evil.example"}, {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                    {"origin": f"http://localhost:{cp.ports['admin']}"}):
        r = get(cp, **headers)
        assert r.status_code == 403, headers
        assert r.json()["error"]["type"] == "forbidden"


def raw_get(cp: ControlPlane, *header_lines: str) -> tuple[int, dict]:
    """GET /admin/v1/models over a bare socket with exactly `header_lines` (httpx would mend a broken Host)."""
    with socket.create_connection(("127.0.0.1", cp.ports["admin"]), timeout=10) as sock:
        sock.sendall(("GET /admin/v1/models HTTP/1.1\r\n" + "".join(h + "\r\n" for h in header_lines)
                      + "Connection: close\r\n\r\n").encode("latin-1"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("lines,param", [
    (("Host: [",), "Host"), (("Host: [::1",), "Host"), (("Host: [::1]x",), "Host"),
    (("Host: 127.0.0.1", "Origin: http://["), "Origin"), (("Host: 127.0.0.1", "Origin: http://[::1"), "Origin"),
])
def test_a_malformed_host_or_origin_is_400_in_the_envelope(cp, lines, param):
    """Issue 36: `Host: [` or `Origin: http://[` was a text 500 with a traceback from the guard."""
    status, body = raw_get(cp, *lines)
    assert status == 400, (lines, status, body)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, body
    assert "Traceback" not in json.dumps(body)
    token = (cp.state / "admin.token").read_text().strip()
    for host in (f"[::1]:{cp.ports['admin']}", "[::1]", f"127.0.0.1:{cp.ports['admin']}"):  # well-formed: served
        assert raw_get(cp, f"Host: {host}", f"Authorization: Bearer {token}")[0] == 200, host


def test_changes_are_accepted_only_as_json(cp):
    r = httpx.post(cp.admin + "/admin/v1/keys", content=b'{"name": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert "application/json" in r.json()["error"]["message"]


def test_on_loopback_too_every_request_needs_the_token(cp):
    """Issue 36: on loopback the token had been optional, and any local user of a shared GPU box (or a
    container on the host network) administered the fleet and read engine keys."""
    token = (cp.state / "admin.token").read_text().strip()  # created at the server's first start
    assert len(token) >= 32 and (cp.state / "admin.token").stat().st_mode & 0o077 == 0
    assert get(cp, authorization=f"Bearer {token}").status_code == 200
    for method, path in (("GET", "/admin/v1/models"), ("GET", "/admin/v1/keys"), ("GET", "/metrics"),
                         ("POST", "/admin/v1/keys"), ("POST", "/admin/v1/catalog")):
        for auth in ({}, {"authorization": "Bearer not-the-token"}, {"authorization": token}):
            r = httpx.request(method, cp.admin + path, headers=auth, json={} if method == "POST" else None, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, auth, r.text)
            assert r.json()["error"]["code"] == "invalid_admin_token"
    assert cp.ctl("models").returncode == 0  # ctl reads the token file: nothing to do on this machine


def test_abusive_json_gets_400_not_500(cp):
    cases = [b'{"catalog": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"catalog": {"models": []}, "x": NaN}',
             b'{"catalog": {"models": [' + b",".join([b"{}"] * 200_000) + b"]}}", b'{"catalog": ' + b"1" * 5000 + b"}"]
    for body in cases:
        r = httpx.post(cp.admin + "/admin/v1/catalog", content=body, timeout=30,
                       headers={"content-type": "application/json", **cp.admin_headers})
        assert r.status_code == 400, (body[:60], r.text[:300])
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_over_the_limit_is_cut_off_with_413(cp):
    """The admin API's app reads a body whole; the listener stops a chunked one at 16 MiB."""
    def chunks():
        for _ in range(17):
            yield b"a" * (1 << 20)
    r = httpx.post(cp.admin + "/admin/v1/catalog", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **cp.admin_headers})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_fleet_page_is_the_one_answer_without_the_token_and_holds_no_data(cp):
    """Issue 44: a browser cannot send a bearer header when it opens a URL, so the static page is served
    without it; everything it shows it reads with the token. Only GET/HEAD of exactly /fleet, and still not
    across sites."""
    r = httpx.get(cp.admin + "/fleet", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text[:200]
    assert r.headers["server"] == "llmgw-admin"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert "/admin/v1/models" in r.text and "Authorization: 'Bearer ' + token" in r.text
    for method, path in (("POST", "/fleet"), ("GET", "/fleet/"), ("GET", "/fleet/../admin/v1/keys"), ("GET", "/fleetx"),
                         ("GET", "/admin/v1/models")):
        r = httpx.request(method, cp.admin + path, json={} if method == "POST" else None, timeout=10)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
    r = httpx.get(cp.admin + "/fleet", headers={"Sec-Fetch-Site": "cross-site"}, timeout=10)
    assert r.status_code == 403
    out = cp.ctl("page")
    token = cp.admin_headers["authorization"].removeprefix("Bearer ")
    assert out.returncode == 0 and out.stdout.strip() == f"{cp.admin}/fleet#token={token}", out


def test_beyond_loopback_every_request_needs_the_token_and_ctl_sends_it(tmp_path, database_url):
    plane = ControlPlane(tmp_path, database_url, f"127.0.0.1:{free_port()}", LLMGW_ADMIN_HOST="0.0.0.0")
    try:
        plane.start(worker=False)
        r = httpx.get(plane.admin + "/admin/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        token = (plane.state / "admin.token").read_text().strip()
        r = httpx.get(plane.admin + "/admin/v1/models", headers={"authorization": f"Bearer {token}"}, timeout=10)
        assert r.status_code == 200
        out = plane.ctl("models")  # reads the token file from the state directory
        assert out.returncode == 0, out.stderr
        out = plane.ctl("keys", "list")
        assert out.returncode == 0, out.stderr
        elsewhere = {**plane.env, "LLMGW_STATE_DIR": str(tmp_path / "another"), "LLMGW_ADMIN_TOKEN": token}
        plane.env, saved = elsewhere, plane.env  # another machine: only the environment variable
        try:
            assert plane.ctl("models").returncode == 0
        finally:
            plane.env = saved
        # Another machine without the variable: ctl had nothing to send, and says where it looked.
        r = run_ctl({**plane.env, "LLMGW_STATE_DIR": str(tmp_path / "another")}, "models")
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert (f"there was none to send: LLMGW_ADMIN_TOKEN is unset and {tmp_path / 'another' / 'admin.token'} "
                "(LLMGW_STATE_DIR) cannot be read") in r.stderr, r.stderr
    finally:
        plane.stop()


def run_ctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_refused_token_is_told_by_where_ctl_took_it_from(cp, tmp_path):
    """Issue 43: ctl sent the token file of the user's own `llmgw dev` to another server, which refused it
    with a message that could not say which token it got. ctl knows: the variable, or the file's path."""
    wrong = "llmgw-admin-" + "w" * 43
    base = {k: v for k, v in cp.env.items() if k not in ("LLMGW_STATE_DIR", "LLMGW_ADMIN_TOKEN", "XDG_DATA_HOME")}

    r = run_ctl({**base, "LLMGW_STATE_DIR": str(cp.state), "LLMGW_ADMIN_TOKEN": wrong}, "models")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error (401): the admin API at {cp.admin} refused the token in LLMGW_ADMIN_TOKEN; "
                               "set LLMGW_ADMIN_TOKEN to that server's token"), r.stderr
    assert wrong not in r.stderr

    other = tmp_path / "other-state"
    home = tmp_path / "home"
    for state in (other, home / ".local" / "share" / "llmgw"):
        state.mkdir(parents=True)
        (state / "admin.token").write_text(wrong + "\n")
    r = run_ctl({**base, "LLMGW_STATE_DIR": str(other)}, "keys", "list")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"refused the token read from {other / 'admin.token'} (LLMGW_STATE_DIR)" in r.stderr, r.stderr
    assert "set LLMGW_STATE_DIR to that server's state directory, or LLMGW_ADMIN_TOKEN to its token" in r.stderr

    # The case: no variable set, the default state directory of a user's own `llmgw dev`.
    r = run_ctl({**base, "HOME": str(home)}, "models")
    assert r.returncode == 1, r.stderr
    assert (f"refused the token read from {home / '.local' / 'share' / 'llmgw' / 'admin.token'} "
            "(the default state directory, as LLMGW_STATE_DIR is unset)") in r.stderr, r.stderr
    assert wrong not in r.stderr


def test_docker_compose_publishes_the_admin_api_only_behind_its_token():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    server = compose["services"]["server"]
    env = server["environment"]
    host = env.get("LLMGW_ADMIN_HOST", "127.0.0.1")
    published = [p for p in server.get("ports", []) if str(p).endswith(":8081")]
    # Listening beyond loopback inside the container makes the server require the token; and the port
    # is published on the host's loopback only.
    assert not loopback_only(host) or not published
    assert all(str(p).startswith("127.0.0.1:") for p in published), published
    assert "LLMGW_ADMIN_TOKEN" not in json.dumps(env) or "${" in json.dumps(env)  # no token in the file


def test_unknown_routes_and_methods_get_the_error_envelope_on_both_apis(cp):
    """Framework errors (no route, wrong method) through the real listeners: 404/405 in the same JSON
    envelope as every other error, on the admin API and on the gateway's FastAPI part alike."""
    for base in (cp.admin, cp.gateway):
        r = httpx.get(base + "/no/such/thing", timeout=10, headers=cp.admin_headers if base == cp.admin else None)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (base, r.text)
        assert "no such route: GET /no/such/thing" in r.json()["error"]["message"]
    r = httpx.delete(cp.admin + "/admin/v1/catalog", timeout=10,
                     headers={"Content-Type": "application/json", **cp.admin_headers})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    r = httpx.put(cp.gateway + "/v1/models", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text


def test_a_nul_character_is_400_in_a_dry_run_and_an_apply_alike_and_in_a_path(cp):
    """Postgres stores no NUL: a catalog holding one passed the dry run (so `ctl apply` showed the diff and
    asked) and then failed the apply with a 500; a NUL in a key id or model name in the path was a 500."""
    before = httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json()
    for profile in ({"engine": "sim", "source": "/models/a\u0000b"}, {"engine": "sim", "name": "p\u0000"},
                    {"engine": "sim", "env": {"X": "a\u0000"}}):
        for dry_run in (True, False):
            r = httpx.post(cp.admin + "/admin/v1/catalog", timeout=10, json={"dry_run": dry_run, "catalog": {
                "models": [{"name": "nul", "scaling": {"max": 1}, "profiles": [profile]}]}}, headers=cp.admin_headers)
            assert r.status_code == 400, (profile, dry_run, r.text)
            assert any("NUL" in p or "control characters" in p or "not allowed" in p
                       for p in r.json()["error"]["problems"]), r.json()
    assert httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json() == before
    for method, path in (("POST", "/admin/v1/keys/a%00b"), ("POST", "/admin/v1/keys/a%00b/revoke"),
                         ("GET", "/admin/v1/explain/a%00b"), ("GET", "/admin/v1/usage?tenant=a%00b")):
        r = httpx.request(method, cp.admin + path, json={} if method == "POST" else None, timeout=10,
                          headers=cp.admin_headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", (path, r.text)


def test_a_profile_name_with_a_newline_or_an_escape_is_refused(cp):
    """It became `replicas.profile` and reached `ctl replicas` as it was: a forged row, a raw escape."""
    for name in ("p\n\u001b[31mX", "\u001b[2K", "   "):
        r = httpx.post(cp.admin + "/admin/v1/catalog", timeout=10, json={"catalog": {"models": [
            {"name": "esc", "scaling": {"max": 1}, "profiles": [{"engine": "sim", "name": name}]}]}}, headers=cp.admin_headers)
        assert r.status_code == 400, r.text
        assert any(p.startswith("models[0] (esc).profiles[0]") and "profile name" in p
                   for p in r.json()["error"]["problems"]), r.json()


def test_every_args_and_env_problem_of_a_profile_is_refused_at_once_each_with_its_rewrite(cp):
    """Issue 44: apply named only the first bad arg, so each fix cost one more apply."""
    r = httpx.post(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers, json={"catalog": {"models": [
        {"name": "m", "scaling": {"max": 1}, "profiles": [{
            "engine": "llamacpp", "source": "mirror:x.gguf", "env": {"FOO": "1"},
            "args": ["-c", "4096", "--parallel=2", "--ctx-sise", "5", "--threads", "x", "--port", "5", "--bogus"]}]}]}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "catalog_refused", r.text
    problems = [p.removeprefix("models[0] (m).profiles[0] (default): ") for p in r.json()["error"]["problems"]]
    assert problems[0].startswith("env: FOO is not allowed for llamacpp; allowed: ")
    assert problems[1:4] == [
        "args: short flags such as '-c' are not accepted; write the long form (--ctx-size)",
        'args: --parallel=2: llamacpp does not read --flag=value; write the flag and its value as two items: '
        '"--parallel", "2"'] + problems[3:4], problems
    assert problems[3].startswith("args: --ctx-sise is not an allowed llamacpp flag (did you mean --ctx-size?)")
    assert "Allowed llamacpp flags: --batch-size" in problems[3]
    assert problems[4:] == [
        "args: --threads takes an integer, not 'x'", "args: --port is set by the node worker; remove it",
        "args: --bogus is not an allowed llamacpp flag. Flags are matched whole (an engine would expand a prefix to "
        "a flag that is not allowed). The allowed flags are listed above."], problems


def test_ctl_given_an_argument_that_is_not_utf8_says_so_in_one_line(cp):
    for args in (("explain", "\udcff"), ("tenants", "set", "\udcff", "--rpm", "5"), ("usage", "--tenant", "\udcff"),
                 ("keys", "create", "--name", "a\udcff")):
        out = cp.ctl(*args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "is not UTF-8 text" in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


async def test_a_mirror_whose_listing_is_not_an_object_is_a_warning_not_a_500(tmp_path):
    """The warnings run after the catalog is stored: an AttributeError there answered 500 for an applied
    catalog and skipped waking the reconciler."""
    from aiohttp import web

    from llmgw.catalog import read_catalog
    from llmgw.control.mirror_check import mirror_warnings

    async def listing(request):
        return web.json_response([])

    app = web.Application()
    app.router.add_get("/files", listing)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        catalog = read_catalog({"models": [{"name": "g", "scaling": {"max": 1},
                                            "profiles": [{"engine": "llamacpp", "source": "mirror:x.gguf"}]}]}).catalog
        [warning] = await mirror_warnings(catalog, f"http://127.0.0.1:{port}")
        assert warning.startswith(f"could not ask the mirror at http://127.0.0.1:{port} whether it holds x.gguf")
    finally:
        await runner.cleanup()


def test_the_codec_endpoint_says_when_there_is_no_payload_key(cp):
    """Without LLMGW_PAYLOAD_KEY nothing is encrypted: the codec endpoint says so (and wants the token first)."""
    url = cp.admin + "/admin/v1/codec/decode"
    assert httpx.post(url, json={"payloads": []}, timeout=10).status_code == 401
    r = httpx.post(url, json={"payloads": []}, headers=cp.admin_headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_payload_key", r.text
