"""The chat page in a real browser (headless Chromium through chromedriver), against a real gateway,
control plane and sim engines (issue 14): the picker shows each model's readiness (ready, loading, on
demand, failing: the cause), ready models first; Enter sends and Shift+Enter makes a new line; the answer
streams in; Send is disabled and Stop enabled while it streams, and Stop ends the stream (the gateway sees
the client leave); a failed turn is shown with its cause and not sent again; usable at 400 px.

Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them when missing). Without them the
test is skipped, unless LLMGW_REQUIRE_BROWSER=1 (as in CI), where their absence fails it.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.browser import BROWSER_WIDTH
from tests.helpers import wait_until
from tests.test_operator_view import SIGILL, sigill_server

pytestmark = pytest.mark.integration
WIDTH = BROWSER_WIDTH


def statuses(cp) -> dict[str, str]:
    return {m["name"]: m["status"] for m in httpx.get(cp.admin + "/admin/v1/models", timeout=10, headers=cp.admin_headers).json()}


def metric_499(cp, model: str) -> float:
    text = httpx.get(cp.gateway + "/metrics", timeout=10).text
    m = re.search(rf'^llmgw_requests_total{{model="{model}",status="499"}} ([0-9.]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_chat_page_in_a_browser(control_plane, tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    cp = control_plane
    cp.env["LLMGW_START_BACKOFF_BASE_S"] = "60"  # the broken model stays failing while we look
    cp.start()
    cp.agent("n1", LLMGW_LLAMA_SERVER=sigill_server(tmp_path))
    cp.wait_nodes("n1")
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    sim = lambda *args: [{"engine": "sim", "args": list(args)}]  # noqa: E731
    assert cp.apply({"models": [
        {"name": "broken", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "llamacpp", "source": str(weights)}]},
        {"name": "fast", "scaling": {"min": 1, "max": 1}, "profiles": sim("--tokens-per-second", "200")},
        {"name": "slow", "scaling": {"min": 1, "max": 1}, "profiles": sim("--tokens-per-second", "4")},
        {"name": "warming", "scaling": {"min": 1, "max": 1}, "profiles": sim("--startup-delay", "600")},
        {"name": "od", "scaling": {"min": 0, "max": 1}, "profiles": sim()},
    ]}).status_code == 200
    want = {"broken": "failing", "fast": "ready", "slow": "ready", "warming": "loading", "od": "on demand"}
    wait_until(lambda: statuses(cp) == want, timeout_s=90, what=f"statuses {want}", why=lambda: statuses(cp))

    b = browser
    b.get(cp.gateway + "/")
    picker = Select(b.find_element(By.ID, "model"))

    def options() -> list[str]:
        return [o.text for o in picker.options[1:]]

    wait_until(lambda: len(options()) == 5, timeout_s=15, what="the picker filled")
    opts = options()
    assert [o.split(" ")[0] for o in opts] == ["fast", "slow", "warming", "od", "broken"], opts  # ready first
    assert opts[0] == "fast (simulated) — ready" and opts[2] == "warming (simulated) — loading", opts
    assert opts[3] == "od (simulated) — on demand", opts
    assert opts[4].startswith("broken — failing: " + SIGILL), opts
    assert b.find_element(By.ID, "model").get_attribute("value") == ""  # nothing preselected

    # Usable at 400 px: nothing wider than the window, Send and the picker on screen.
    assert b.execute_script("return document.documentElement.scrollWidth") <= b.execute_script("return window.innerWidth")
    for el_id in ("model", "send", "stop", "prompt"):
        rect = b.find_element(By.ID, el_id).rect
        assert rect["x"] >= 0 and rect["x"] + rect["width"] <= WIDTH, (el_id, rect)

    # Record what the page sends (to show that a failed turn is not sent again).
    b.execute_script("""window.__sent = []; const f = window.fetch;
        window.fetch = (u, o) => { if (o && o.body) window.__sent.push(JSON.parse(o.body)); return f(u, o); };""")
    prompt = b.find_element(By.ID, "prompt")
    send, stop = b.find_element(By.ID, "send"), b.find_element(By.ID, "stop")
    log = lambda: [(d.get_attribute("class"), d.text) for d in b.find_elements(By.CSS_SELECTOR, "#log div")]  # noqa: E731

    # A failing model: the turn fails with the cause, and is marked as not sent again.
    picker.select_by_value("broken")
    assert SIGILL in b.find_element(By.ID, "status").text
    prompt.send_keys("first", Keys.ENTER)
    wait_until(lambda: any(c == "error" for c, _ in log()), timeout_s=30, what="the failed turn")
    [(_, err)] = [(c, t) for c, t in log() if c == "error"]
    assert "is failing" in err and SIGILL in err and "retry in" in err, err
    assert "unsent" in log()[0][0]

    # Shift+Enter is a new line, Enter sends; the answer streams in, complete.
    picker.select_by_value("fast")
    prompt.send_keys("line one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "line two")
    assert prompt.get_attribute("value") == "line one\nline two" and len(b.execute_script("return window.__sent")) == 1
    prompt.send_keys(Keys.ENTER)
    wait_until(lambda: log()[-1][0] == "assistant" and len(log()[-1][1].split()) >= 100 and not send.get_property("disabled"),
               timeout_s=30, what="the fast answer")
    assert log()[-2] == ("user", "line one\nline two")
    assert log()[-1][1].startswith("α β γ δ")
    sent = b.execute_script("return window.__sent")
    assert sent[-1]["model"] == "fast" and sent[-1]["stream"] is True
    assert sent[-1]["messages"] == [{"role": "user", "content": "line one\nline two"}]  # "first" failed: not resent

    # A long answer: Send disabled and Stop enabled while it streams; Stop ends it where it was.
    picker.select_by_value("slow")
    before = metric_499(cp, "slow")
    prompt.send_keys("tell me a long story", Keys.ENTER)
    wait_until(lambda: log()[-1][0] == "assistant" and log()[-1][1].strip(), timeout_s=30, what="the slow stream")
    assert send.get_property("disabled") and not stop.get_property("disabled")
    prompt.send_keys("typed meanwhile", Keys.ENTER)  # Enter while streaming sends nothing
    stop.click()
    wait_until(lambda: "stopped" in log()[-1][0] and not send.get_property("disabled"), timeout_s=10, what="stopped")
    assert stop.get_property("disabled")
    partial = log()[-1][1]
    time.sleep(1.0)
    assert log()[-1][1] == partial and len(partial.split()) < 100  # nothing more arrived
    wait_until(lambda: metric_499(cp, "slow") > before, timeout_s=10, what="the gateway saw the client leave")
    assert sum(1 for s in b.execute_script("return window.__sent") if s["model"] == "slow") == 1
    assert prompt.get_attribute("value") == "typed meanwhile"
