"""llmgw: run a fleet of LLM inference engines and serve them through one OpenAI-compatible gateway."""

__version__ = "0.1.0"
