"""Pre-staging (issue 39) through the real processes: an on-demand model used a moment ago and now stopped
has its weights fetched ahead onto the node its next start would take, when that node lacks them; the next
request starts it there without fetching anything."""

from __future__ import annotations

import os
import re

import httpx
import pytest

from llmgw.weights.naming import cache_name_for
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CATALOG = {"models": [{"name": "od", "scaling": {"min": 0, "max": 1, "idle_timeout": "3s"},
                       "profiles": [{"engine": "sim", "source": "mirror:w.bin", "gpus_per_node": 1, "disk_gb": 1}]}]}
CHAT = {"model": "od", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def mirror_files(cp) -> float:
    text = httpx.get(f"http://127.0.0.1:{cp.ports['mirror']}/metrics", timeout=10).text
    m = re.search(r'^llmgw_mirror_requests_total\{kind="file"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def live(cp, model: str) -> list[dict]:
    return [r for r in cp.replicas() if r["model"] == model and r["status"] not in ("stopped", "failed", "lost")]


def test_weights_are_staged_where_the_next_start_goes_and_that_start_fetches_nothing(control_plane):
    cp = control_plane.start(mirror=True)
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    (cp.mirror_dir / "w.bin").write_bytes(os.urandom(2 << 20))
    name = cache_name_for("mirror:w.bin")
    agents = {n: cp.agent(n, simulate=sim_spec(gpus=1)) for n in ("node-a", "node-b")}
    cp.wait_nodes(*agents)
    assert cp.apply(CATALOG).status_code == 200

    assert httpx.post(cp.gateway + "/v1/chat/completions", json=CHAT, timeout=120).status_code == 200
    [first] = [r for r in cp.replicas() if r["model"] == "od"]
    ran_on = first["node_id"]
    other = next(n for n in agents if n != ran_on)
    wait_until(lambda: not live(cp, "od"), timeout_s=60, what="od stopped for being idle", why=cp.logs)
    assert mirror_files(cp) == 1
    assert not (cp.state / "cache" / other / name).exists()  # where it ran holds them: nothing to stage yet

    agents[ran_on].stop()  # that machine leaves: the next start would go to the other
    wait_until(lambda: (cp.state / "cache" / other / name).exists(), timeout_s=60,
               what=f"od's weights staged on {other}", why=lambda: f"{cp.explain('od')}\n{cp.logs()}")
    assert not live(cp, "od")  # fetched, nothing launched
    assert any(line.startswith(f"stage od's weights on {other}: last used") for line in cp.explain("od")["decisions"]), \
        cp.explain("od")
    assert mirror_files(cp) == 2
    nodes = lambda: httpx.get(cp.admin + "/admin/v1/nodes", timeout=10, headers=cp.admin_headers).json()  # noqa: E731
    wait_until(lambda: any(n["id"] == other and name in n["inventory"]["cached_sources"] for n in nodes()),
               timeout_s=30, what=f"{other}'s inventory lists the staged weights")

    assert httpx.post(cp.gateway + "/v1/chat/completions", json=CHAT, timeout=120).status_code == 200
    [second] = live(cp, "od")
    assert second["node_id"] == other
    assert "rung: start from the weights already in its cache (no fetch)" in second["reason"], second["reason"]
    assert mirror_files(cp) == 2  # the start fetched nothing
