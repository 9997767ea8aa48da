"""The prompt bound's rules (catalog/context.py and the gateway's count of a prompt's text); the same rules
through a real gateway: tests/test_gateway_api.py (`short-prompts`, `small-context`) and, against a real
llama-server, tests/test_dev_e2e.py."""

from __future__ import annotations

import pytest

from llmgw.catalog.context import (
    CHARS_PER_TOKEN, MAX_PROMPT_CHARS, OutputBound, declared_context, output_bound, prompt_bound, text_only,
)
from llmgw.catalog.loader import CatalogError, parse_catalog
from llmgw.gateway.openai_api import media_part, prompt_chars
from llmgw.schemas.catalog import Model, Profile


@pytest.mark.parametrize("engine,args,env,tokens", [
    # llama-server's context is shared by its slots: --parallel 2 logs `n_ctx_slot = 2048, kv_unified = 'false'`
    ("llamacpp", ["--ctx-size", "4096", "--parallel", "2"], {}, 2048),
    ("llamacpp", ["--ctx-size", "4096", "--parallel", "2", "--kv-unified"], {}, 4096),  # one request may use all
    ("llamacpp", ["--ctx-size", "4096", "--kv-unified", "--parallel", "2", "--no-kv-unified"], {}, 2048),  # last wins
    ("llamacpp", ["--ctx-size", "4096", "--parallel", "1"], {}, 4096),
    ("llamacpp", ["--ctx-size", "4096"], {}, 4096),  # --parallel left to it: 4 slots over a unified cache
    ("llamacpp", ["--ctx-size", "4096", "--parallel", "-1"], {}, 4096),
    ("llamacpp", ["--ctx-size", "4096"], {"LLAMA_ARG_N_PARALLEL": "4"}, 1024),
    ("llamacpp", ["--ctx-size", "4096"], {"LLAMA_ARG_N_PARALLEL": "4", "LLAMA_ARG_KV_UNIFIED": "true"}, 4096),
    ("llamacpp", [], {"LLAMA_ARG_CTX_SIZE": "8192", "LLAMA_ARG_N_PARALLEL": "2"}, 4096),
    ("llamacpp", ["--ctx_size", "1024"], {}, 1024),  # llama-server reads `_` as `-`
    ("llamacpp", ["--ctx-size", "512", "--ctx-size", "2048"], {}, 2048),  # the last one given wins
    ("llamacpp", [], {"LLAMA_ARG_CTX_SIZE": "2048"}, 2048),
    ("llamacpp", ["--ctx-size", "1024"], {"LLAMA_ARG_CTX_SIZE": "8192"}, 1024),  # a flag beats its variable
    ("llamacpp", ["--ctx-size", "0"], {}, None),  # 0: the model's own, which only the weights know
    ("llamacpp", ["--ctx-size", "4k"], {}, None),  # llama-server reads no suffix
    ("llamacpp", [], {}, None),
    ("vllm", ["--max-model-len", "8192"], {}, 8192),
    ("vllm", ["--max-model-len=32k"], {}, 32_000),  # vLLM's human-readable numbers: k is 1000 ...
    ("vllm", ["--max_model_len", "32K"], {}, 32_768),  # ... K is 1024
    ("vllm", ["--max-model-len", "-1"], {}, None),  # the model's own
    ("sglang", ["--context-length", "16384"], {}, 16384),
    ("sglang", ["--context-length=16384"], {}, 16384),
    ("sim", ["--tokens-per-second", "50"], {}, None),
])
def test_the_context_a_profile_declares_is_read_as_its_engine_reads_it(engine, args, env, tokens):
    assert declared_context(Profile(engine=engine, args=args, env=env)) == tokens


def test_a_models_bound_is_its_limit_else_its_context_else_the_setting():
    ctx = [Profile(engine="llamacpp", args=["--ctx-size", "4096"])]
    assert prompt_bound(Model(name="m", profiles=ctx)).chars == 4096 * CHARS_PER_TOKEN
    # A profile that declares none: the engine may take any context, so only the setting bounds it.
    mixed = [*ctx, Profile(name="cpu", engine="sim")]
    assert prompt_bound(Model(name="m", profiles=mixed)).chars == MAX_PROMPT_CHARS
    # The largest context of the profiles; the setting caps what a context allows ...
    two = [*ctx, Profile(name="big", engine="vllm", args=["--max-model-len", "8192"])]
    assert prompt_bound(Model(name="m", profiles=two)).context == 8192
    assert prompt_bound(Model(name="m", profiles=two), most=1000).chars == 1000
    # ... but not the model's own limit, which is the operator's word.
    limited = Model(name="m", profiles=two, limits={"max_prompt_chars": 50_000_000})
    assert prompt_bound(limited, most=1000).chars == 50_000_000
    assert prompt_bound(Model(name="m", endpoints=["http://e:1"])).chars == MAX_PROMPT_CHARS


def test_what_a_choice_without_a_cap_may_generate_is_the_operators_cap_else_the_context_else_the_bounds():
    """Issue 37: reserved for an accounted request that sets no length cap; only the operator's cap is sent
    (an engine stops at its context anyway, and vLLM refuses a max_tokens that does not fit beside the prompt)."""
    def bound(m: Model) -> OutputBound:
        return output_bound(m, prompt_bound(m))

    ctx = [Profile(engine="llamacpp", args=["--ctx-size", "4096"])]
    assert bound(Model(name="m", profiles=ctx)) == OutputBound(4096, "context", False)
    capped = Model(name="m", profiles=ctx, limits={"max_output_tokens": 512})
    assert bound(capped) == OutputBound(512, "limits.max_output_tokens", True)
    limited = Model(name="m", profiles=ctx, limits={"max_prompt_chars": 1000})  # the context still bounds output
    assert bound(limited) == OutputBound(4096, "context", False)
    far = Model(name="m", endpoints=["http://e:1"])  # nothing declared: the context the prompt bound implies
    assert bound(far) == OutputBound(MAX_PROMPT_CHARS // CHARS_PER_TOKEN, "prompt bound", False)


def test_a_prompts_text_is_counted_and_nothing_else():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1000}}
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"}, image]},
                {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "f"}]
    assert prompt_chars("/v1/chat/completions", {"messages": messages}) == 6
    assert prompt_chars("/v1/completions", {"prompt": "hello"}) == 5
    assert prompt_chars("/v1/completions", {"prompt": ["hi", "hello", [1, 2, 3]]}) == 5  # the longest prompt
    assert prompt_chars("/v1/completions", {"prompt": [1, 2, 3]}) == 0  # token ids
    assert prompt_chars("/v1/embeddings", {"input": ["a", "bcd"]}) == 3
    assert prompt_chars("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 4}]}) == 4  # characters


def test_a_limit_that_is_not_a_count_is_refused_at_apply():
    with pytest.raises(CatalogError) as err:
        parse_catalog({"models": [{"name": "m", "endpoints": ["http://e:1"], "limits": {"max_prompt_chars": 0}}]})
    assert "max_prompt_chars" in str(err.value)


@pytest.mark.parametrize("setting", ["allow", ["http://images.example.com"], ["a b"], ["*"], ["x"] * 65, 3])
def test_a_media_urls_setting_that_is_not_refuse_public_or_host_names_is_refused_at_apply(setting):
    with pytest.raises(CatalogError) as err:
        parse_catalog({"models": [{"name": "m", "endpoints": ["http://e:1"], "limits": {"media_urls": setting}}]})
    assert "media_urls" in str(err.value)
    ok = parse_catalog({"models": [{"name": "m", "endpoints": ["http://e:1"],
                                    "limits": {"media_urls": ["*.example.com", "cdn.example.org"]}}]})
    assert ok.models[0].limits.media_urls == ["*.example.com", "cdn.example.org"]


def test_only_a_model_served_by_llamacpp_alone_is_text_only():
    gguf = Profile(engine="llamacpp", source="/m.gguf")
    assert text_only(Model(name="m", profiles=[gguf]))
    assert not text_only(Model(name="m", profiles=[gguf, Profile(name="gpu", engine="vllm", source="org/m")]))
    assert not text_only(Model(name="m", endpoints=["http://e:1"]))
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert media_part({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, image]}]}) == "messages[1].content[1]"
    assert media_part({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}) is None
    assert media_part({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}) == "messages[0].content[0]"


def test_every_field_a_chat_template_renders_is_counted():
    """Issue 36: tools, tool calls, schemas, names, reasoning and a completion's suffix (the real path:
    tests/test_gateway_api.py `test_every_field_the_template_renders_counts_towards_the_prompt_bound`)."""
    chat = "/v1/chat/completions"
    user = {"role": "user", "content": "abc"}
    tools = [{"type": "function", "function": {"name": "ab", "description": "cde",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    # keys too: type(4)+function(4) | function(8)+{name(4)+ab(2)+description(11)+cde(3)+parameters(10)+{...}}
    assert prompt_chars(chat, {"messages": [user], "tools": tools}) == 3 + (
        4 + 8 + 8 + 4 + 2 + 11 + 3 + 10 + (4 + 6 + 10 + 1 + 4 + 6))
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "12345"}}]}
    assert prompt_chars(chat, {"messages": [user, call]}) == 3 + (2 + 1) + (4 + 8) + (8 + 4 + 1 + 9 + 5)
    # a message's own fields count by value (the template writes the name, not the key), what is inside by both
    assert prompt_chars(chat, {"messages": [{**user, "name": "bob"}]}) == 3 + 3
    assert prompt_chars(chat, {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "xyz"}]}) == 1 + 3
    assert prompt_chars(chat, {"messages": [user], "response_format": {"type": "json_object"}}) == 3 + 4 + 11
    assert prompt_chars("/v1/completions", {"prompt": ["ab", "abcd"], "suffix": "xyz"}) == 4 + 3
    assert prompt_chars("/v1/completions", {"prompt": "ab", "suffix": None}) == 2
