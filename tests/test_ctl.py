"""`llmgw ctl` with the field's habits (issue 14): one clear line for every expected failure, help without
type noise on flags, a header and AGE on every table, `-o table|wide|json|yaml` on every listing, and the
live catalog round-tripping through `ctl catalog` and `ctl apply -f`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import typer
import yaml
from typer.testing import CliRunner

from llmgw.cli import app, quiet_flag_types
from llmgw.version import VERSION
from llmgw.dev.procs import free_port
from tests.fleet import sim_spec

# Every ctl command that talks to the admin API, with arguments that would be valid against a live one.
ADMIN_COMMANDS = [
    ["models"], ["models", "-o", "json"], ["replicas"], ["replicas", "--all", "-o", "wide"], ["nodes"],
    ["explain", "m"], ["logs", "abcdef12"], ["logs", "abcdef12", "--follow"], ["retry", "m"], ["catalog"],
    ["apply", "-f", "{catalog}", "--yes"], ["reclaim"], ["reclaim", "--collect"], ["keys", "create", "--name", "x"],
    ["keys", "list"], ["keys", "revoke", "k1", "--yes"], ["models", "--watch"],
]


def run_ctl(env: dict, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_every_ctl_command_against_a_stopped_admin_api_says_so_in_one_line(tmp_path):
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(LLMGW_ADMIN_PORT=str(port), LLMGW_STATE_DIR=str(tmp_path / "state"))
    f = tmp_path / "catalog.yaml"
    f.write_text(yaml.safe_dump({"models": [{"name": "m", "scaling": {"min": 1, "max": 1},
                                             "profiles": [{"engine": "sim"}]}]}))
    commands = [[a.format(catalog=f) for a in c] for c in ADMIN_COMMANDS]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: run_ctl(env, *c), commands))
    for cmd, r in zip(commands, results):
        assert r.returncode == 1, (cmd, r.returncode, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", (cmd, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert r.stderr.startswith(f"cannot reach the admin API at http://127.0.0.1:{port}: nothing answers there"), \
            (cmd, r.stderr)


def test_ctl_sent_to_a_program_that_is_not_llmgw_says_what_answered(tmp_path):
    """A web page where the admin API should be: what answered (its server, type, title), never "error (200)"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        server_version = "SomeWiki/2.1"

        def do_GET(self):
            body = b"<html><head><title>Team wiki</title></head><body>hello</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(LLMGW_ADMIN_URL=f"http://127.0.0.1:{httpd.server_port}", LLMGW_ADMIN_TOKEN="llmgw-admin-x")
        r = run_ctl(env, "models")
    finally:
        httpd.shutdown()
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1 and "error (200)" not in r.stderr, r
    assert "answered HTTP 200 with something that is not llmgw's admin API (a server that calls itself " \
        "'SomeWiki/2.1 " in r.stderr and "answering text/html, titled 'Team wiki')" in r.stderr, r.stderr


def test_a_bad_choice_is_refused_in_plain_words():
    """Typer 0.29 printed pydantic's "Value error, " before the message."""
    r = run_ctl({**os.environ, "LLMGW_ADMIN_PORT": "1"}, "models", "-o", "xml")
    assert r.returncode == 2 and "Value error" not in r.stderr, r.stderr
    assert "'xml' is not one of 'table', 'wide', 'json', 'yaml'." in " ".join(
        line.strip("│ ") for line in r.stderr.splitlines()), r.stderr


def test_a_new_key_or_admin_token_never_starts_with_a_separator_after_its_prefix():
    from llmgw.security.api_keys import KEY_PREFIX, new_key, random_token

    keys = [new_key() for _ in range(3000)]  # a token starts with - or _ one time in 32
    assert all(k.startswith(KEY_PREFIX) and k[len(KEY_PREFIX)].isalnum() and len(k) == len(KEY_PREFIX) + 43
               for k in keys)
    assert all(random_token()[0].isalnum() for _ in range(3000))


def _commands(cmd, path: list[str]):
    yield path, cmd
    if hasattr(cmd, "commands"):  # a group
        for name, sub in cmd.commands.items():
            yield from _commands(sub, path + [name])


def test_help_shows_no_type_beside_flags():
    quiet_flag_types()  # what `main()` does before running the app
    runner = CliRunner()
    root = typer.main.get_command(app)
    checked = 0
    for path, _ in _commands(root, []):
        r = runner.invoke(app, [*path, "--help"], terminal_width=200)
        assert r.exit_code == 0, (path, r.output)
        assert "<bool>" not in r.output, (path, r.output)
        checked += 1
    assert checked > 20
    # The installed command does the same (main() installs it).
    r = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "replicas", "--help"], capture_output=True, text=True)
    assert "--all" in r.stdout and "<bool>" not in r.stdout


def ctl_here(cp, *args: str) -> subprocess.CompletedProcess:
    """`llmgw ctl ...` run in this process (the same app, over real HTTP to the admin API): for the many reads
    of a listing in each format, which as subprocesses cost a second of start-up each. What depends on the
    process itself (input, signals, exit codes of a script) is run as a subprocess, by `cp.ctl`."""
    result = CliRunner().invoke(app, ["ctl", *args], env=cp.env, catch_exceptions=False)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.mark.integration
def test_listings_have_headers_age_and_every_output_format_and_the_catalog_round_trips(control_plane, tmp_path):
    cp = control_plane.start()
    cp.agent("n1", simulate=sim_spec(gpus=2))
    cp.wait_nodes("n1")
    f = tmp_path / "catalog.yaml"
    f.write_text(yaml.safe_dump({"models": [
        {"name": "s", "aliases": ["s-alias"], "scaling": {"min": 1, "max": 1, "idle_timeout": "5m"},
         "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]},
        {"name": "od", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]},
    ]}))
    out = cp.ctl("apply", "-f", str(f), "--yes")
    assert out.returncode == 0, out.stderr
    cp.wait_replicas("s", timeout_s=60)

    # ctl sent to another llmgw listener says which it reached (its `server` header), not "error (404)".
    wrong = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "models"],
                           env={**cp.env, "LLMGW_ADMIN_URL": cp.gateway}, capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 1 and wrong.stdout == "" and wrong.stderr.count("\n") == 1, wrong
    assert f"{cp.gateway} is llmgw's gateway (the OpenAI API), not llmgw's admin API (HTTP 404 for GET " \
        "/admin/v1/models); set LLMGW_ADMIN_URL (or LLMGW_ADMIN_PORT) to the admin listener" in wrong.stderr, wrong

    out = ctl_here(cp, "keys", "list")  # no keys: a header, and a line saying what that means
    assert out.returncode == 0 and out.stdout.split() == ["ID", "PREFIX", "NAME", "TENANT", "STATUS", "AGE"], out.stdout
    assert "no API keys" in out.stderr

    listings = {"models": ("MODEL", "s"), "replicas": ("REPLICA", "s"), "nodes": ("NODE", "n1"),
                "keys list": ("ID", None), "tenants list": ("NAME", None), "reclaim": ("NODE", None)}
    for listing, (first, name) in listings.items():
        args = listing.split()
        for fmt in ("table", "wide"):
            out = ctl_here(cp, *args, "-o", fmt)
            assert out.returncode == 0, (listing, fmt, out.stderr)
            header = out.stdout.splitlines()[0].split()
            assert header[0] == first and "AGE" in header, (listing, fmt, out.stdout)
            if name:
                assert any(line.split()[:2] and name in line.split()[:2] for line in out.stdout.splitlines()[1:])
        as_json = json.loads(ctl_here(cp, *args, "-o", "json").stdout)
        as_yaml = yaml.safe_load(ctl_here(cp, *args, "-o", "yaml").stdout)
        assert type(as_json) is type(as_yaml), listing
    models = {m["name"]: m for m in json.loads(ctl_here(cp, "models", "-o", "json").stdout)}
    assert models["s"]["status"] == "ready" and models["od"]["status"] == "on demand"
    assert "on demand" in [line for line in ctl_here(cp, "models").stdout.splitlines() if line.startswith("od ")][0]
    wide = ctl_here(cp, "nodes", "-o", "wide").stdout
    assert "FABRICS" in wide.splitlines()[0] and "(simulated)" in wide
    # each node's version, as its worker registered it (issue 38: which nodes an upgrade has reached)
    table = wide.splitlines()
    at = table[0].split().index("VERSION")
    assert [line.split()[at] for line in table[1:] if line.startswith("n1 ")] == [VERSION], table
    # POLLERS reads right for a healthy node (issue 44): polling as of the witness's last read, not "48s ago"
    n1 = next(line for line in table if line.startswith("n1 "))
    assert "POLLERS" in table[0] and re.search(r"\bpolling, read \d+s ago\b", n1), table

    # The live catalog round-trips: printed, applied back unchanged, edited, applied with the change shown.
    live = ctl_here(cp, "catalog")
    assert live.returncode == 0 and live.stdout.startswith("# The live catalog at "), live.stdout
    back = tmp_path / "live.yaml"
    back.write_text(live.stdout)
    out = ctl_here(cp, "apply", "-f", str(back), "--yes")
    assert out.returncode == 0 and "no changes" in out.stdout, (out.stdout, out.stderr)
    edited = yaml.safe_load(live.stdout)
    edited["models"][1]["scaling"]["max"] = 2
    back.write_text(yaml.safe_dump(edited))
    out = ctl_here(cp, "apply", "-f", str(back), "--yes")
    assert "  ~ od\n      scaling.max: 1 -> 2" in out.stdout and out.stdout.rstrip().endswith("applied"), out.stdout
    assert json.loads(ctl_here(cp, "catalog", "-o", "json").stdout)["models"][1]["scaling"]["max"] == 2

    # Errors from a live admin API are one line too.
    out = ctl_here(cp, "retry", "nope")
    assert out.returncode == 1 and out.stderr == "error (404): no model or alias named 'nope' in the catalog\n"
    out = ctl_here(cp, "explain", "nope")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "404" in out.stderr
    for command in ("explain", "retry"):  # a typo: the name meant
        out = ctl_here(cp, command, "s-alis")
        assert out.returncode == 1 and "no model or alias named 's-alis' in the catalog; did you mean 's-alias'?" \
            in out.stderr, (command, out.stderr)
    out = ctl_here(cp, "retry", "s-alias")
    assert out.returncode == 0 and out.stdout.startswith("s: no failed starts to clear"), out.stdout

    # Not YAML: the file, line and column, not PyYAML's `<unicode string>`.
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  - name: a\n    scaling: {min: 1\n")
    out = cp.ctl("apply", "-f", str(broken), "--yes")
    assert out.returncode == 2 and f"{broken}:4:1: not valid YAML" in out.stderr, out.stderr
    # An empty file (or only comments) is refused locally, saying what to write; it had reached the server
    # as "catalog: Input should be a valid dictionary".
    for text in ("", "# nothing yet\n"):
        broken.write_text(text)
        out = cp.ctl("apply", "-f", str(broken), "--yes")
        assert out.returncode == 2 and "is empty (or only comments); write `models: [...]`" in out.stderr, out.stderr

    # A file with no models would remove every model: said before asking; answered no, nothing changes.
    empty = tmp_path / "empty.yaml"
    empty.write_text("models: []\n")
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "apply", "-f", str(empty)], env=cp.env, input="n\n",
                         capture_output=True, text=True, timeout=30)
    assert "removes all 2 model(s) of the live catalog (od, s)" in out.stdout and "  - s\n" in out.stdout, out.stdout
    assert out.returncode != 0 and "not applied" in out.stdout + out.stderr, (out.stdout, out.stderr)
    assert len(json.loads(ctl_here(cp, "catalog", "-o", "json").stdout)["models"]) == 2
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "apply", "-f", str(empty)], env=cp.env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)  # a script: no answer
    assert out.returncode == 1 and "needs an answer, and none came on the input; nothing was changed. Add --yes" \
        in out.stderr and "Aborted" not in out.stderr, out.stderr
    assert len(json.loads(ctl_here(cp, "catalog", "-o", "json").stdout)["models"]) == 2

    # Key names need not be unique (a key is rotated under its name), but a second key of a name is asked about
    # first, its namesakes named by id (issue 44); a script with no answer changes nothing.
    first = cp.ctl("keys", "create", "--name", "ci")
    assert first.returncode == 0 and "also named" not in first.stderr, first.stderr
    keys = {k["name"] or "-": k for k in json.loads(ctl_here(cp, "keys", "list", "-o", "json").stdout)}
    old = keys["ci"]["id"]

    def create_ci(*extra: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "keys", "create", "--name", "ci", *extra],
                              env=cp.env, capture_output=True, text=True, timeout=30, **kw)

    refused = create_ci(stdin=subprocess.DEVNULL)
    assert refused.returncode == 1 and not re.search(r"llmgw-[\w-]{43}", refused.stdout), refused  # no key made
    assert f"1 active key(s) are already named 'ci': {old} (" in refused.stderr and "Add --yes" in refused.stderr, \
        refused.stderr
    named_ci = lambda: [k for k in json.loads(ctl_here(cp, "keys", "list", "-o", "json").stdout)  # noqa: E731
                        if k["name"] == "ci" and not k["revoked_at"]]
    assert len(named_ci()) == 1
    second = create_ci("--yes")
    assert second.returncode == 0 and second.stdout.strip() != first.stdout.strip()
    assert "1 other active key(s) are also named 'ci'" in second.stderr, second.stderr
    assert "revoke it by id: `llmgw ctl keys revoke ID`" in second.stderr
    asked = create_ci(input="y\n")  # answered yes on the input; the question on stderr, stdout the key alone
    assert asked.returncode == 0 and "2 active key(s) are already named 'ci'" in asked.stderr, asked.stderr
    assert re.fullmatch(r"llmgw-[\w-]{43}\n", asked.stdout), asked.stdout
    assert len(named_ci()) == 3
    # A key is named by the start of its id when no other id starts so (as git names commits).
    assert cp.ctl("keys", "revoke", old[:5], "--yes").returncode == 0
    assert old not in [k["id"] for k in named_ci()] and len(named_ci()) == 2
    by_name = cp.ctl("keys", "revoke", "ci", "--yes")
    assert by_name.returncode == 1 and "2 active key(s) named so: revoke by id (`llmgw ctl keys revoke " \
        in by_name.stderr, by_name.stderr

    # An argument is one path segment of the admin URL, whatever it holds: a node "named" with a path to
    # another endpoint names no node (this revoked the key, in the dry run that asks nothing), and a model
    # "named" `../keys?` is no model; each is one line, never a traceback.
    victim = cp.ctl("keys", "create", "--name", "victim")
    victim_id = re.search(r"created key (\S+)", victim.stderr).group(1)
    for args in (["nodes", "remove", f"../keys/{victim_id}/revoke?"], ["nodes", "remove", ".."],
                 ["explain", "../keys?"], ["retry", "../../v1/keys"], ["logs", "../../etc/passwd"]):
        out = ctl_here(cp, *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1, (args, out)
    key_view = json.loads(ctl_here(cp, "keys", "list", "-o", "json").stdout)
    assert not next(k for k in key_view if k["id"] == victim_id)["revoked_at"], key_view

    # --watch stops on SIGINT even when its parent handed SIGINT down ignored (a script's background job).
    watcher = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "replicas", "--watch", "--interval", "0.2"],
                               env=cp.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        # Read on a thread: a watch that prints nothing fails the deadline instead of blocking a readline.
        header = ThreadPoolExecutor(1).submit(lambda: any("REPLICA" in line for line in watcher.stdout))
        try:
            assert header.result(timeout=30), "the watch ended without printing a table"
        except TimeoutError:
            pytest.fail("the watch printed no table in 30 s")
        watcher.send_signal(signal.SIGINT)
        _, err = watcher.communicate(timeout=10)
        assert watcher.returncode == 0 and "Traceback" not in err, err
    finally:
        watcher.kill()
        watcher.wait()


@pytest.mark.parametrize("args, says", [
    (["tenants", "create", "t1", "--tokens-per-day", "20X"],
     "--tokens-per-day '20X' is not a whole number: write one such as 60, 10k, 2M or 1G, or `none` for no limit"),
    (["tenants", "create", "t1", "--rpm", "0"], "--rpm 0: a limit is at least 1; write `--rpm none` for no limit"),
    (["keys", "create", "--name", "k", "--tpm", "-5"], "--tpm -5: a limit is at least 1; write `--tpm none` for no limit"),
    (["tenants", "set", "t1", "--tokens-per-month", "1.5"], "--tokens-per-month '1.5' is not a whole number"),
])
def test_a_limit_option_the_admin_api_would_refuse_is_refused_in_the_option_s_own_words(args, says, monkeypatch):
    # No admin API anywhere: the value is refused before anything is sent (a port nothing listens on).
    monkeypatch.setenv("LLMGW_ADMIN_PORT", str(free_port()))
    out = CliRunner().invoke(app, ["ctl", *args])
    assert out.exit_code == 1, out.output
    assert says in out.output
    assert "Traceback" not in out.output


def test_limit_options_take_suffixes_and_none():
    from llmgw.ctl.tenants import limits_body
    assert limits_body("10k", "2M", "1G", "none", "a-*,b") == {
        "rpm": 10_000, "tpm": 2_000_000, "tokens_per_day": 10**9, "tokens_per_month": None, "models": ["a-*", "b"]}


def test_namesakes_are_named_up_to_five_and_an_id_prefix_names_one_key_or_is_refused(capsys):
    from datetime import datetime, timezone

    from llmgw.ctl.keys import listed, namesakes, resolve

    made = "2026-12-02T11:00:00Z"

    class FakeAdmin:
        now = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)

        def get(self, path):
            assert path == "/admin/v1/keys"
            return ([{"id": f"k{i:02d}", "name": "ci", "prefix": f"llmgw-{i:04d}", "created_at": made,
                      "revoked_at": None} for i in range(12)]
                    + [{"id": "r", "name": "ci", "prefix": "x", "created_at": made, "revoked_at": made},
                       {"id": "abc123", "name": "other", "prefix": "y", "created_at": made, "revoked_at": None}])

    admin = FakeAdmin()
    others = namesakes(admin, "ci")
    assert [k["id"] for k in others] == [f"k{i:02d}" for i in range(12)]  # the revoked one is no namesake
    text = listed(others[1:], admin.now)
    assert text.startswith("k01 (llmgw-0001..., created 1h ago), k02 (") and "k05 (" in text and "k06 (" not in text
    assert text.endswith("and 6 more (`llmgw ctl keys list`)"), text
    assert resolve(admin, "abc", "set")["id"] == "abc123" and resolve(admin, "k03", "set")["id"] == "k03"
    for ref, says in (("k0", "'k0' is the start of 10 key ids (k00, k01"), ("zz", "no API key with id 'zz'"),
                      ("ci", "12 active key(s) named so: set by id (`llmgw ctl keys set k00`; ids: k00 or k01")):
        with pytest.raises(typer.Exit):
            resolve(admin, ref, "set")
        assert says in capsys.readouterr().err


def test_a_limit_is_shown_as_the_options_take_it_and_reads_back_the_same():
    from llmgw.ctl.tenants import limit_number, limit_value, limits_text

    shown = {n: limit_number(n) for n in (60, 1000, 10_000, 20_000_000, 2_500_000, 1_000_000_000_000, 1234567)}
    assert shown == {60: "60", 1000: "1k", 10_000: "10k", 20_000_000: "20M", 2_500_000: "2500k",
                     1_000_000_000_000: "1T", 1234567: "1234567"}
    assert all(limit_value(text) == n for n, text in shown.items())
    assert limit_number(None) == "-"
    # Decimal, not float: 4.1 * 10**6 is 4099999.9999999995 in floats, which had been refused as not whole.
    assert [limit_value(t) for t in ("4.1M", "0.3k", "2.675G", "1.1T")] == [4_100_000, 300, 2_675_000_000, 1_100_000_000_000]
    assert limits_text({"rpm": 60, "tpm": 20_000_000, "tokens_per_day": 10**6, "models": None}) == "rpm 60, tpm 20M, 1M/day"


def test_cert_never_replaces_a_certificate_in_use_unasked_and_takes_only_real_hosts(tmp_path):
    # `ctl cert server --host 'a b'` had overwritten the live server certificate: after a restart every
    # agent failed its handshake, and every model was unplaceable.
    d = str(tmp_path / "pki")

    def cert(*args: str):
        out = CliRunner().invoke(app, ["ctl", "cert", *args, "--dir", d])
        assert "Traceback" not in out.output
        return out

    assert cert("ca").exit_code == 0
    assert cert("server", "--host", "127.0.0.1", "--host", "gpu-api.example.internal").exit_code == 0
    first = (tmp_path / "pki" / "server.crt").read_bytes()
    again = cert("server", "--host", "10.0.0.1")
    assert again.exit_code == 2 and "already exists and may be in use; pass --force to replace it" in again.output
    assert (tmp_path / "pki" / "server.crt").read_bytes() == first
    assert cert("server", "--host", "10.0.0.1", "--force").exit_code == 0
    assert (tmp_path / "pki" / "server.crt").read_bytes() != first
    for args in (["server", "--host", "a b", "--force"], ["node", "gpu-x", "--address", "1.2.3.4/8"],
                 ["node", "gpu-y", "--address", "not a host!"], ["node", "gpu-z", "--address", "-bad.example"]):
        out = cert(*args)
        assert out.exit_code == 2 and "is neither an IP address nor a DNS name" in out.output, (args, out.output)
    assert not (tmp_path / "pki" / "node-gpu-x.crt").exists()
    assert cert("node", "local").exit_code == 0
    assert cert("node", "local").exit_code == 2
