"""Engine name → adapter, for one node."""

from __future__ import annotations

from llmgw.engines.base import EngineAdapter, EngineError
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.sim import SimAdapter


class Engines:
    """The adapters a node worker can launch. vLLM and SGLang adapters arrive with their packages."""

    def __init__(self, llama_server: str | None = None):
        self.adapters: dict[str, EngineAdapter] = {"sim": SimAdapter()}
        llama = LlamaCppAdapter(llama_server)
        if llama.available():
            self.adapters["llamacpp"] = llama

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def get(self, engine: str) -> EngineAdapter:
        try:
            return self.adapters[engine]
        except KeyError:
            raise EngineError(f"engine {engine!r} is not available on this node (available: {', '.join(self.names())})") from None
