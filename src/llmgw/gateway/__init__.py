"""The OpenAI data plane: parse, keys, quotas, routes, balancer, proxy, upstream, SSE, load on demand, the chat page.
It imports no other process folder (tests/test_layout.py); `llmgw server` (server.py) runs it beside the admin API."""
