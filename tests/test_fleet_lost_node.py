"""A node dies. Through the real path, with short timings: it is Unreachable first (its replica is
neither routed to nor torn down), then Lost (its replica is rebuilt on another node), while a model on
another node serves every request throughout."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.fleet import sim_spec
from tests.helpers import POLLER_GRACE_S, wait_until

pytestmark = pytest.mark.integration

UNREACHABLE_S, LOST_S = 4, 20
ROUTE_REFRESH_S = 2  # LLMGW_ROUTE_REFRESH_S default: how soon a gateway notices a silent node
CATALOG = {"models": [
    # Placed first (higher priority), so it lands on node-a, the first node by id.
    {"name": "moving", "priority": 1, "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]},
    {"name": "steady", "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]},
]}


def chat(cp, model: str) -> int:
    try:
        return httpx.post(cp.gateway + "/v1/chat/completions", timeout=10, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code
    except httpx.HTTPError:
        return 0


def test_a_lost_nodes_replicas_move_while_an_unaffected_model_keeps_serving(control_plane):
    cp = control_plane
    cp.env.update(LLMGW_NODE_UNREACHABLE_AFTER_S=str(UNREACHABLE_S), LLMGW_NODE_LOST_AFTER_S=str(LOST_S))
    cp.start()
    cp.agent("node-a", simulate=sim_spec(gpus=1))
    cp.agent("node-b", simulate=sim_spec(gpus=2))
    cp.wait_nodes("node-a", "node-b")
    assert cp.apply(CATALOG).status_code == 200
    [moving] = cp.wait_replicas("moving", timeout_s=60)
    [steady] = cp.wait_replicas("steady", timeout_s=60)
    assert moving["node_id"] == "node-a" and steady["node_id"] == "node-b"
    wait_until(lambda: chat(cp, "steady") == 200 and chat(cp, "moving") == 200, timeout_s=15, what="both serving")

    codes: list[int] = []
    done = threading.Event()

    def keep_asking():
        while not done.is_set():
            codes.append(chat(cp, "steady"))
            time.sleep(0.1)
    asker = threading.Thread(target=keep_asking, daemon=True)
    asker.start()
    try:
        killed_at = time.monotonic()
        cp.kill_node("node-a")

        # Unreachable: no new requests go to node-a, and its replica is neither lost nor replaced yet.
        wait_until(lambda: any(n["id"] == "node-a" and n["status"] == "unreachable"
                               for n in httpx.get(cp.admin + "/admin/v1/nodes", headers=cp.admin_headers).json()),
                   timeout_s=UNREACHABLE_S + POLLER_GRACE_S + 5, what="node-a unreachable")
        mid = [r for r in cp.replicas() if r["model"] == "moving"]
        assert time.monotonic() - killed_at < LOST_S
        # POLLERS in `ctl nodes` (issue 44): the live node is polling as of its last read, the dead one silent.
        pollers = {n["id"]: n["pollers"] for n in httpx.get(cp.admin + "/admin/v1/nodes", headers=cp.admin_headers).json()}
        assert pollers["node-a"].startswith("silent ") and pollers["node-b"].startswith("polling, read "), pollers
        assert [(r["id"], r["status"]) for r in mid] == [(moving["id"], "ready")], mid
        # Within its refresh interval the gateway stops routing there; it waits briefly for a Ready replica
        # (5 s), then answers "loading". All well before Lost.
        time.sleep(ROUTE_REFRESH_S + 0.5)
        assert chat(cp, "moving") == 503
        assert time.monotonic() - killed_at < LOST_S

        # Lost: the replica is marked lost and rebuilt on node-b.
        [new] = cp.wait_replicas("moving", exclude={moving["id"]}, timeout_s=LOST_S + 30)
        assert time.monotonic() - killed_at >= LOST_S
        assert new["node_id"] == "node-b"
        # The replacement's start and the lost replica's stop run side by side: either may land first.
        old = wait_until(lambda: next((r for r in cp.replicas() if r["id"] == moving["id"] and r["status"] == "lost"), None),
                         timeout_s=15, what="the replica on node-a marked lost")
        assert old["status"] == "lost" and "node node-a is lost" in old["ended_reason"]
        wait_until(lambda: chat(cp, "moving") == 200, timeout_s=15, what="moving serving again")
        placed = next(r for r in cp.explain("moving")["replicas"] if r["id"] == new["id"])["reason"]
        assert "default on node-a: node is lost" in placed
    finally:
        done.set()
        asker.join(15)
    assert codes and set(codes) == {200}, f"steady answered {sorted(set(codes))} while node-a died"
    assert [r["id"] for r in cp.replicas() if r["model"] == "steady"] == [steady["id"]]
