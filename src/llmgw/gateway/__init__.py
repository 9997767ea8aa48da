"""The gateway process: OpenAI API (hot path + FastAPI), admin API, node API, chat page."""
