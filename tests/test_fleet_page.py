"""The fleet page (issue 44) in a real browser (headless Chromium through chromedriver, as the chat page's
test), against a real control plane, node agent, gateway and sim engines: models with their status, nodes with
their replicas (each linked to its Temporal history), the recent failures with their causes, tokens per tenant
and day as a chart; the token taken from the URL's fragment and then out of the address bar; refreshing live.
A screenshot is kept in `$LLMGW_ARTIFACTS_DIR` (default `.ci/artifacts/`) for CI to keep."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until
from tests.test_chat_page import statuses
from tests.test_operator_view import SIGILL, sigill_server

pytestmark = pytest.mark.integration
ARTIFACTS = Path(os.environ.get("LLMGW_ARTIFACTS_DIR") or Path(__file__).parent.parent / ".ci" / "artifacts")


def test_the_fleet_page_in_a_browser(control_plane, tmp_path, browser):
    from selenium.webdriver.common.by import By

    cp = control_plane
    cp.env["LLMGW_START_BACKOFF_BASE_S"] = "60"  # the broken model stays failing while we look
    cp.start()
    cp.agent("n1", LLMGW_LLAMA_SERVER=sigill_server(tmp_path))
    cp.wait_nodes("n1")
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    models = [{"name": "fast", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]},
              {"name": "broken", "scaling": {"min": 1, "max": 1},
               "profiles": [{"engine": "llamacpp", "source": str(weights)}]}]
    assert cp.apply({"models": models}).status_code == 200
    headers = cp.admin_headers
    assert httpx.post(cp.admin + "/admin/v1/tenants", json={"name": "acme"}, headers=headers, timeout=10).status_code == 200
    key = httpx.post(cp.admin + "/admin/v1/keys", json={"name": "k", "tenant": "acme"}, headers=headers,
                     timeout=10).json()["key"]
    wait_until(lambda: statuses(cp) == {"fast": "ready", "broken": "failing"}, timeout_s=90, what="fast ready, broken failing",
               why=lambda: statuses(cp))
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                                  timeout=30).status_code == 200, timeout_s=20, what="a request of acme answered")

    b = browser
    b.get(cp.admin + "/fleet")  # no token yet: the page says what to give it, and shows nothing
    wait_until(lambda: "Enter the admin token" in b.find_element(By.ID, "error").text, timeout_s=10, what="the ask")
    token = headers["authorization"].removeprefix("Bearer ")
    b.get(cp.admin + "/fleet#token=" + token)

    # Each view is read in one script: the page re-renders every few seconds, and elements found by one WebDriver
    # call can be gone by the next (a stale element reference).
    def rows(table: str) -> list[list[str]]:
        return b.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map("
            "tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()))", f"#{table} tbody tr")

    wait_until(lambda: len(rows("models")) == 2, timeout_s=15, what="the models table",
               why=lambda: b.find_element(By.ID, "error").text + "\n" + "\n".join(
                   str(e) for e in b.get_log("browser")))
    assert b.execute_script("return location.hash") == "" and token not in b.current_url  # out of the address bar
    assert b.execute_script("return sessionStorage.getItem('llmgw-admin-token')") == token
    by_name = {r[0].split(" ")[0]: r for r in rows("models")}
    assert by_name["fast"][1] == "ready" and by_name["fast"][2] == "1", by_name
    assert by_name["broken"][1] == "failing" and SIGILL in by_name["broken"][6], by_name

    [node] = rows("nodes")
    assert node[0] == "n1" and node[1] == "ready" and "fast " in node[5], node
    links = {text.split(" ")[0]: href for text, href in b.execute_script(
        "return [...document.querySelectorAll('#nodes a')].map(a => [a.innerText.trim(), a.href])")}
    assert links["fast"].startswith("http://") and "workflows" in links["fast"], links  # its Temporal UI history
    failures = b.execute_script("return [...document.querySelectorAll('#failures li')].map(li => li.innerText.trim())")
    assert failures and all(f.startswith("broken ") and SIGILL in f for f in failures), failures

    def acme_tokens() -> int:
        return b.execute_script("return [...document.querySelectorAll('#usage rect[data-tenant=\"acme\"]')]"
                                ".reduce((sum, r) => sum + Number(r.dataset.tokens), 0)")
    wait_until(lambda: acme_tokens() > 0, timeout_s=20, what="acme's tokens in the chart")

    # Live: a model applied now appears without a reload.
    models.append({"name": "later", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]})
    assert cp.apply({"models": models}).status_code == 200
    wait_until(lambda: any(r[0].startswith("later") for r in rows("models")), timeout_s=15, what="later shown live")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    b.set_window_size(1280, 900)
    assert b.save_screenshot(str(ARTIFACTS / "fleet-page.png"))
