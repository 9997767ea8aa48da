"""Where each engine says how many requests wait in its own queue: a gauge of its `/metrics` page, read by
the gateway to know that a model's replicas are saturated (gateway/engine_queues.py, issue 37)."""

from __future__ import annotations

from llmgw.engines.metrics_text import gauge_sum

WAITING = {
    "vllm": "vllm:num_requests_waiting",  # vllm/v1/metrics/loggers.py: requests its scheduler holds
    "sglang": "sglang:num_queue_reqs",  # sglang/srt/metrics/collector.py
    "llamacpp": "llamacpp:requests_deferred",  # llama-server's, served with `--metrics` (engines/llamacpp.py)
    "sim": "sim:num_requests_waiting",  # its `--max-num-seqs` (engines/sim_server.py)
}


def waiting(engine: str, page: str) -> int | None:
    """Requests waiting in `engine`'s queue as its metrics `page` says; None when it does not say. An engine
    not named in `WAITING` (a static endpoint's, "unknown") is read by the first of their gauges its page has."""
    for name in (WAITING[engine],) if engine in WAITING else WAITING.values():
        if name not in page:
            continue
        n = gauge_sum(page, name)
        if n is None or n != n or n < 0:  # absent, NaN, or nonsense
            return None
        return int(n)
    return None
