"""README command 2 after README command 1 (issue 43): what a user has from running llmgw themselves (a past or
running `llmgw dev` in ~/.local/share/llmgw, exported LLMGW_* settings) changes no test's result.

The proof is a child pytest run of the two tests that meet such state: the API-keys test, whose
`llmgw ctl keys create` once sent the user's admin token to the test's admin API, and the `llmgw dev`
end-to-end test. The child runs with a decoy HOME, and decoy variables that point at nonsense; it passes only
because tests/conftest.py's `hermetic_environment` takes them away. Marked e2e: each run is `llmgw dev` with
SmolLM2, about two minutes.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

pytestmark = pytest.mark.e2e

CHILD_TESTS = [
    "tests/test_gateway_keys.py::test_keys_required_once_created_and_revocation_is_prompt",
    "tests/test_dev_e2e.py::test_llmgw_dev_serves_smollm2_and_sim_end_to_end",
]
DECOY_TOKEN = "llmgw-admin-decoy-" + "x" * 40


def decoy_state(state: Path) -> None:
    """A state directory as a running `llmgw dev` leaves it: its token, a catalog of its own, its URLs."""
    (state / "run").mkdir(parents=True)
    (state / "admin.token").write_text(DECOY_TOKEN + "\n")
    (state / "admin.token").chmod(0o600)
    (state / "catalog.yaml").write_text(yaml.safe_dump(
        {"models": [{"name": "decoy", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}]}))
    (state / "run" / "urls.json").write_text(json.dumps({"gateway": "http://127.0.0.1:1", "admin": "http://127.0.0.1:1"}))


# One run holds both: the state of the user's own `llmgw dev` in HOME (the issue as reported) and the settings
# a user's shell may hold, each pointing at nothing that works, an exported state directory among them. The
# HOME decoy is held and checked too, so a fixture that dropped LLMGW_STATE_DIR but kept HOME (falling back to
# the user's own state) fails as surely as one that kept the exported settings. (It ran once per kind of
# decoy: the same child run twice, ~2.7 minutes of CI each.)
EXPORTED = {
    "LLMGW_ADMIN_TOKEN": "decoy",  # too short: a server given it refuses to start
    "LLMGW_DATABASE_URL": "postgresql://decoy@127.0.0.1:1/decoy", "LLMGW_TEMPORAL_ADDRESS": "127.0.0.1:1",
    "LLMGW_ADMIN_URL": "http://127.0.0.1:1", "LLMGW_GATEWAY_PORT": "1", "LLMGW_NODE_ID": "decoy",
}


@pytest.mark.timeout(900)
def test_the_users_own_llmgw_state_and_settings_change_no_result(tmp_path):
    home = tmp_path / "home"
    user_state = home / ".local" / "share" / "llmgw"  # where the user's own `llmgw dev` keeps its state
    exported_state = tmp_path / "exported-state"  # where an exported LLMGW_STATE_DIR points
    decoys = [user_state, exported_state]
    for state in decoys:
        decoy_state(state)
    env = {k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"}  # a user's shell usually has none
    env.update({
        "HOME": str(home),
        # The real cache, as the child's fixture keeps it: else the decoy HOME's empty one, and SmolLM2 again.
        "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
    })
    env.pop("LLMGW_STATE_DIR", None)  # this session's own, set by its fixture
    env.update(EXPORTED, LLMGW_STATE_DIR=str(exported_state), LLMGW_CACHE_DIR=str(tmp_path / "decoy-cache"))
    # The decoy is where llmgw looks: without the fixture, the child's state directory is the decoy's.
    where = subprocess.run([sys.executable, "-c", "from llmgw.config import Settings; print(Settings().state_dir)"],
                           env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip() == str(decoys[-1])

    log = tmp_path / "child.log"
    locks = []
    try:
        for state in decoys:  # held as a running `llmgw dev` holds it
            fd = os.open(state / "dev.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locks.append(fd)
        with open(log, "wb") as out:
            child = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *CHILD_TESTS],
                                   cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=840)
    finally:
        for fd in locks:
            os.close(fd)
    output = log.read_text(errors="replace")
    assert child.returncode == 0 and "2 passed" in output, output[-6000:]
    for state in decoys:  # and nothing was written into the user's state
        assert (state / "admin.token").read_text().strip() == DECOY_TOKEN
        assert sorted(p.name for p in state.iterdir()) == ["admin.token", "catalog.yaml", "dev.lock", "run"]
