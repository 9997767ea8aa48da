"""Engine name → adapter, for one node."""

from __future__ import annotations

from llmgw.engines.base import EngineAdapter, EngineError
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.sglang import SglangAdapter
from llmgw.engines.sim import SimAdapter
from llmgw.engines.vllm import VllmAdapter


class Engines:
    """The adapters a node worker can launch: sim always; llama.cpp, vLLM and SGLang when installed
    (their executables or Python are configurable: LLMGW_LLAMA_SERVER, LLMGW_VLLM, LLMGW_RAY,
    LLMGW_SGLANG_PYTHON). A node advertises only what it can launch."""

    def __init__(self, llama_server: str | None = None, vllm: str | None = None, ray: str | None = None,
                 sglang_python: str | None = None):
        self.adapters: dict[str, EngineAdapter] = {"sim": SimAdapter()}
        for adapter in (LlamaCppAdapter(llama_server), VllmAdapter(vllm, ray), SglangAdapter(sglang_python)):
            if adapter.available():
                self.adapters[adapter.name] = adapter

    def describe(self) -> str:
        """`engine: what runs it` for each engine this node can launch (the agent says it at start)."""
        return "; ".join(f"{name}: {self.adapters[name].executable()}" for name in self.names())

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def get(self, engine: str) -> EngineAdapter:
        try:
            return self.adapters[engine]
        except KeyError:
            raise EngineError(f"engine {engine!r} is not available on this node (available: {', '.join(self.names())})") from None
