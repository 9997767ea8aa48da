"""Versions (issue 38): `llmgw --version` says pyproject.toml's, and the node API reads a node worker's
version from its `User-Agent` only when it is llmgw's, bounded."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from llmgw.cli import app
from llmgw.version import USER_AGENT, VERSION, from_user_agent, minor

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_llmgw_version_prints_the_projects_version():
    want = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.stdout.strip() == f"llmgw {want}" == f"llmgw {VERSION}"
    assert minor(VERSION) is not None


def test_a_node_version_is_read_from_an_llmgw_user_agent_only():
    assert from_user_agent(USER_AGENT) == VERSION
    assert from_user_agent("llmgw/0.3.1 (linux)") == "0.3.1"
    for other in (None, "", "curl/8.5", "llmgw/", "llmgw/" + "9" * 101, "llmgw/0.2\x00", "LLMGW/0.2.0"):
        assert from_user_agent(other) is None, other
