"""Adapter files (issue 40) in units: what the gateway gives the engine for a fetched adapter (the node's
verified copy, never an unverified one), llama.cpp's launch flags and per-request `lora` field, and abusive
adapter files in a node's shard report refused naming the field. The real path is in test_lora_mirror.py and
test_lora_llamacpp.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmgw.engines.base import EngineError, ShardSpec
from llmgw.engines.llamacpp import lora_args
from llmgw.gateway.adapters import launch_id, lora_field, lora_path
from llmgw.gateway.routes import Endpoint
from llmgw.gateway.upstream import parse_target
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Adapter, Profile
from llmgw.schemas.inventory import AdapterFile, ShardReport

FILES = {"good": AdapterFile(path="/cache/ab-good.gguf", id=0), "bad": AdapterFile(error="sha256 mismatch"),
         "other": AdapterFile(path="/cache/cd-other.gguf", id=1)}


def ep(engine: str = "vllm", files: dict | None = None) -> Endpoint:
    e = Endpoint("rep-1", "http://127.0.0.1:1", "node-a", parse_target("http://127.0.0.1:1"))
    e.engine, e.adapter_files = engine, dict(FILES if files is None else files)
    return e


def test_a_fetched_adapter_is_loaded_from_the_verified_copy_and_an_unverified_one_is_refused():
    assert lora_path(ep(), Adapter(name="good", source="mirror:good/")) == "/cache/ab-good.gguf"
    assert lora_path(ep(), Adapter(name="x", source="/srv/x")) == "/srv/x"  # a node path: untouched
    assert lora_path(ep(), Adapter(name="x", source="org/x")) == "org/x"  # a hub id: untouched
    with pytest.raises(APIError) as exc:
        lora_path(ep(), Adapter(name="bad", source="mirror:bad/"))
    assert exc.value.status == 503 and exc.value.code == "adapter_unverified"
    assert "failed verification on node node-a: sha256 mismatch" in exc.value.message
    with pytest.raises(APIError) as exc:  # added after the replica started: no file there at all
        lora_path(ep(), Adapter(name="new", source="https://h/new.safetensors"))
    assert "started before it was added" in exc.value.message


def test_llamacpp_selects_one_adapter_per_request_listing_every_launched_one():
    e = ep("llamacpp")
    assert lora_field(e, Adapter(name="other", source="mirror:o.gguf")) == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]
    assert lora_field(e, None) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]  # the base: none applied
    assert launch_id(e, Adapter(name="good", source="mirror:g.gguf")) == 0
    with pytest.raises(APIError) as exc:
        lora_field(e, Adapter(name="bad", source="mirror:b.gguf"))
    assert exc.value.code == "adapter_unverified"


def test_llamacpp_is_launched_with_each_verified_adapter_in_id_order():
    spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile=Profile(engine="llamacpp"),
                     adapter_files={"other": FILES["other"], "bad": FILES["bad"], "good": FILES["good"]})
    assert lora_args(spec) == ["--lora", "/cache/ab-good.gguf", "--lora", "/cache/cd-other.gguf",
                               "--lora-init-without-apply"]
    spec.adapter_files = {}
    assert lora_args(spec) == []
    spec.adapter_files = {"c": AdapterFile(path="/a,b.gguf", id=0)}
    with pytest.raises(EngineError, match="splits --lora at commas"):
        lora_args(spec)


@pytest.mark.parametrize("adapters, field", [
    ({"a": {"id": -1}}, "id"), ({"a": {"id": "zero"}}, "id"), ({"a": {"path": "x" * 5000}}, "path"),
    ({"a": {"error": "e" * 3000}}, "error"),
    ({f"a{i}": {} for i in range(300)}, "adapters"), ({"a": "not an object"}, "adapters"),
])
def test_abusive_adapter_files_in_a_shard_report_are_refused_naming_the_field(adapters, field):
    with pytest.raises(ValidationError) as exc:
        ShardReport(shard_id="s", replica_id="r", model="m", profile="p", state="ready", adapters=adapters)
    assert field in str(exc.value)
