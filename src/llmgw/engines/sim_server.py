"""The sim engine: an OpenAI-compatible server that streams Greek letters at a fixed rate.

It stands in for a GPU engine wherever there is none: it serves `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`, Anthropic's `/v1/messages` (`SimEngine.messages`), `/v1/models`,
`/version`, `/health` and `/metrics`, streaming or not, emitting
tokens from the Greek alphabet (`α β γ …`) at `--tokens-per-second` until `max_tokens` (default 16), for
each of `n` choices (default 1; their tokens interleaved in a stream, as vLLM sends them). Its
models are `owned_by: "llmgw-sim"` (seeds 003, "Say which model is simulated"). `/health` answers 503
until `--startup-delay` seconds have passed (plus `--compile-s` on a cold compile cache: see `compiled_mark`),
then 200 with the number of requests in flight.

Its answers are deterministic, and a continuation reads as one answer: a chat sent
`continue_final_message: true` with `add_generation_prompt: false` (vLLM's fields; refused as vLLM refuses
them) goes on from the Greek letters its final assistant message ends with, as a completion goes on from
those its prompt ends with (gateway/resume.py splices a stream so).

`usage` is reported as OpenAI and vLLM report it: in every non-streamed answer, and for a stream that asks
with `stream_options: {"include_usage": true}` in one last chunk before `[DONE]` with `"choices": []`. Its
prompt tokens are the prompt's words (at least 1), its completion tokens the tokens it emitted. `/metrics`
counts them as vLLM's counters do (`sim:prompt_tokens_total`, `sim:generation_tokens_total`, as each token
is generated, whether or not anyone reads it), which is what the gateway's accounting is checked against.

A prefix cache (`--prefix-cache-blocks N`, blocks of 16 tokens; 0, the default, keeps none) and a prefill
time (`--prefill-tokens-per-second`, one prefill at a time; 0, the default, none) model what a GPU engine's
automatic prefix caching does to time to first token (engines/sim_cache.py): the cache is keyed by the
request's `cache_salt` and its leading blocks, as vLLM's; `cache_prompt: false` reads nothing from it, as
llama-server. With a cache, `usage` carries `prompt_tokens_details.cached_tokens` (as vLLM's does) and
`/metrics` `sim:prefix_cache_queries_total` and `sim:prefix_cache_hits_total` (tokens).

A multi-node (tensor-parallel) sim replica is one process per shard, each with its `--rank`, all given the
replica's `--rendezvous HOST:PORT`, `--world-size` and `--token` (`llmgw.engines.sim_group`): rank 0
listens there and is the only one serving HTTP; its `/health` stays 503 until every worker has joined,
and each request it serves is a collective with every worker. Workers serve nothing; they join rank 0
(retrying while it is not up: workers start first) and exit when it goes away, as rank 0 exits when a
worker does.

Sleep (issue 39), as vLLM's sleep mode is called: `POST /sleep?level=1|2` takes `--sleep-s` seconds, then the
engine holds no accelerator memory (level 1 keeps its weights in host memory, level 2 drops them);
`POST /wake_up` takes `--wake-s` seconds and takes the memory back; `GET /is_sleeping` says which, with the
memory it holds. Requests that arrive while it sleeps wait until it is awake (vLLM's scheduler is paused
the same way); `/health` stays 200. The memory it says it holds awake is `--gpu-memory-mb`; `/metrics`
reports `sim:accelerator_memory_bytes` (that, or 0 asleep), `sim:offloaded_memory_bytes` (host memory
holding its weights asleep at level 1) and `sim:sleep_level` (0 awake), so a test sees the memory released
while asleep and taken back after, by the same process.

A batch bound (`--max-num-seqs N`, vLLM's flag; 0, the default, none): at most N requests generate at once,
the rest wait in arrival order, as vLLM's scheduler holds them; `/metrics` reports
`sim:num_requests_waiting` (vLLM's `vllm:num_requests_waiting`) beside `sim:num_requests_running`, which
the gateway reads to know a model is saturated (gateway/engine_queues.py).

LoRA adapters (issue 40), as vLLM loads them at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; its
`serving_models.py`): `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` takes `--lora-load-s` seconds and
answers 200 with vLLM's text (`Success: LoRA adapter 'x' added successfully.`); `POST /v1/unload_lora_adapter
{"lora_name"}` removes one. Refusals are vLLM's: 400 `InvalidUserInput` without both fields or for a name
already loaded, 404 `NotFoundError` unloading one it does not hold, in vLLM's envelope
(`{"error": {"message", "type", "param", "code"}}`). Stricter than vLLM, which keeps any number loaded and
swaps them through its GPU slots: the sim holds at most `--max-loras` (0, the default: LoRA off, every load
refused) and refuses one more with 400, so the caller's own eviction is what a test sees. With LoRA on, a
request's `model` must be the base or a loaded adapter (vLLM's 404 `The model `x` does not exist.`); an
adapter's answer names it in `model` (as vLLM's do) and in `system_fingerprint` (`lora:NAME`): that is the
marker tests read; its text is the base's, so token counts stay comparable. `/v1/models` lists adapters with `parent` and `root`.

With a key (`LLMGW_SIM_API_KEY`, which the node worker sets, or `--api-key`), every request without
`Authorization: Bearer <key>` is refused with 401, `/health` included: the sim engine holds the node's own
calls to the key as strictly as the gateway's, so a caller that forgets it fails here first.

Run: `python -m llmgw.engines.sim_server --port 9000 --model sim-small [--tokens-per-second 50]`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import time
import uuid
from pathlib import Path

from aiohttp import web

from llmgw.engines.sim_cache import MAX_CACHED_BLOCKS, PrefixCache, prompt_words
from llmgw.engines.sim_group import Group, run_worker
from llmgw.engines.dialects import parse_version, speaks_messages
from llmgw.version import VERSION

GREEK = "α β γ δ ε ζ η θ ι κ λ μ ν ξ ο π ρ σ τ υ φ χ ψ ω".split()
OWNED_BY = "llmgw-sim"

log = logging.getLogger(__name__)


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return web.json_response(body, status=status)


def vllm_error(status: int, message: str, err_type: str) -> web.Response:
    """vLLM's `ErrorResponse` (`{"error": {message, type, param, code}}`, the code the HTTP status)."""
    return web.json_response({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                             status=status)


class SimEngine:
    def __init__(self, model: str, tokens_per_second: float, startup_delay: float, rank: int = 0,
                 group: Group | None = None, cache: PrefixCache | None = None, gpu_memory_mb: int = 1024,
                 sleep_s: float = 0.1, wake_s: float = 0.2, max_loras: int = 0, lora_load_s: float = 0.0,
                 max_num_seqs: int = 0):
        self.model = model
        self.seqs = asyncio.Semaphore(max_num_seqs) if max_num_seqs > 0 else None  # the batch bound
        self.waiting = 0  # requests waiting for a place in the batch
        self.max_loras = max_loras
        self.lora_load_s = lora_load_s
        self.loras: dict[str, str] = {}  # adapter name -> the path it was loaded from, in load order
        self._lora_lock = asyncio.Lock()  # one load or unload at a time (so `max_loras` holds)
        self.gpu_memory_bytes = gpu_memory_mb << 20
        self.sleep_s = sleep_s
        self.wake_s = wake_s
        self.sleep_level = 0  # 0: awake; 1 or 2 while asleep
        self.awake = asyncio.Event()
        self.awake.set()
        self._switch = asyncio.Lock()  # one sleep or wake at a time
        self.cache = cache or PrefixCache(0)
        self.delay = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.ready_at = time.monotonic() + startup_delay
        self.in_flight = 0
        self.rank = rank
        self.group = group
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.engine_version = VERSION  # what /version reports (`--engine-version`: an older engine's)

    def token(self, i: int) -> str:
        return GREEK[i % len(GREEK)] + " "

    def _group_view(self) -> dict:
        if self.group is None:
            return {"world_size": 1, "joined": [0]}
        return {"world_size": self.group.world_size, "joined": self.group.joined}

    async def health(self, request: web.Request) -> web.Response:
        if time.monotonic() < self.ready_at:
            return web.json_response({"status": "loading", **self._group_view()}, status=503)
        if self.group is not None and not self.group.complete:
            return web.json_response({"status": "waiting for ranks to join", **self._group_view()}, status=503)
        return web.json_response({"status": "ok", "in_flight": self.in_flight, "rank": self.rank, **self._group_view()})

    # ---- sleep mode (vLLM's calls) -----------------------------------------------------------------
    def memory(self) -> dict:
        """What it holds now: accelerator memory (none asleep) and host memory holding offloaded weights."""
        return {"accelerator_memory_bytes": 0 if self.sleep_level else self.gpu_memory_bytes,
                "offloaded_memory_bytes": self.gpu_memory_bytes if self.sleep_level == 1 else 0}

    async def sleep(self, request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            level = -1
        if level not in (1, 2):
            return error(422, "`level` must be 1 or 2", param="level")
        async with self._switch:
            if not self.sleep_level:
                self.awake.clear()  # requests arriving from now on wait
                await asyncio.sleep(self.sleep_s)
                self.sleep_level = level
                print(f"sim: asleep at level {level}, holding {self.memory()}", flush=True)
        return web.json_response({"status": "sleeping", "level": self.sleep_level})

    async def wake_up(self, request: web.Request) -> web.Response:
        async with self._switch:
            if self.sleep_level:
                await asyncio.sleep(self.wake_s)
                self.sleep_level = 0
                self.awake.set()
                print(f"sim: awake, holding {self.memory()}", flush=True)
        return web.json_response({"status": "awake", "tags": None})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.sleep_level), "level": self.sleep_level, **self.memory()})

    # ---- LoRA adapters (vLLM's runtime calls) ------------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        print(f"sim: load_lora_adapter called for {str(name)[:200]!r}", flush=True)  # (tests: was it ever asked)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        async with self._lora_lock:
            if name in self.loras:
                return vllm_error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
            if self.max_loras <= 0:
                return vllm_error(400, "LoRA is not enabled (start the engine with --max-loras N)", "BadRequestError")
            if len(self.loras) >= self.max_loras:
                return vllm_error(400, f"{len(self.loras)} adapters are loaded, max_loras is {self.max_loras}: "
                                  "unload one first", "BadRequestError")
            await asyncio.sleep(self.lora_load_s)
            self.loras[name] = path
        print(f"sim: loaded LoRA adapter {name!r} from {path!r}", flush=True)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return vllm_error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput")
        async with self._lora_lock:
            if self.loras.pop(name, None) is None:
                return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        print(f"sim: unloaded LoRA adapter {name!r}", flush=True)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _serving(self, body: dict) -> str | web.Response:
        """The model a request is answered as: the base, or the loaded adapter it names (LoRA on only)."""
        asked = body.get("model")
        if self.max_loras <= 0 or asked in (None, self.model):
            return self.model
        if isinstance(asked, str) and asked in self.loras:
            return asked
        return vllm_error(404, f"The model `{asked}` does not exist.", "NotFoundError")

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: the engine's own token and request counters (as vLLM's `vllm:*_tokens_total`), and
        the memory it holds (sleep mode)."""
        lines = []
        mem = self.memory()
        for name, help_, value in (("sim:accelerator_memory_bytes", "Accelerator memory held", mem["accelerator_memory_bytes"]),
                                   ("sim:offloaded_memory_bytes", "Host memory holding weights offloaded asleep",
                                    mem["offloaded_memory_bytes"]),
                                   ("sim:sleep_level", "Sleep level (0: awake)", self.sleep_level)):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, help_, value in (("sim:prompt_tokens_total", "Prompt tokens processed", self.prompt_tokens_total),
                                   ("sim:generation_tokens_total", "Tokens generated", self.generation_tokens_total),
                                   ("sim:requests_total", "Requests started", self.requests_total),
                                   ("sim:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                                    self.cache.queries),
                                   ("sim:prefix_cache_hits_total", "Prompt tokens found in the prefix cache",
                                    self.cache.hits),
                                   ("sim:num_requests_running", "Requests in flight", self.in_flight),
                                   ("sim:num_requests_waiting", "Requests waiting for a place in the batch",
                                    self.waiting)):
            kind = "gauge" if name.endswith(("running", "waiting")) else "counter"
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": OWNED_BY}] + [
            {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY, "root": path, "parent": self.model}
            for name, path in self.loras.items()]})

    async def _body(self, request: web.Request) -> dict | web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return error(400, "`messages` is required: a non-empty list of {role, content}", param="messages")
        return await self._generate(request, body, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if "prompt" not in body:
            return error(400, "`prompt` is required", param="prompt")
        return await self._generate(request, body, chat=False)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        inputs = body.get("input")
        if inputs is None:
            return error(400, "`input` is required", param="input")
        items = inputs if isinstance(inputs, list) else [inputs]
        self.requests_total += 1
        self.prompt_tokens_total += len(items)
        data = []
        for i, text in enumerate(items):
            digest = hashlib.sha256(str(text).encode()).digest()
            data.append({"object": "embedding", "index": i, "embedding": [b / 255.0 for b in digest[:16]]})
        return web.json_response({"object": "list", "data": data, "model": self.model,
                                  "usage": {"prompt_tokens": len(items), "total_tokens": len(items)}})

    async def version(self, request: web.Request) -> web.Response:
        """`{"version": ...}` as vLLM's `/version` (gateway/dialects.py reads it): llmgw's, or `--engine-version`."""
        return web.json_response({"version": self.engine_version})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's `POST /v1/messages`, served here (from `MESSAGES_SINCE`), so that a test tells a request
        the gateway passed through from one it translated: this answer's id starts `msg_sim_` (a translated
        one's is `msg_` + the chat id). The text is the chat's (Greek letters, `max_tokens` of them); a
        stream sends Anthropic's events, and one of a type no client knows (`sim_note`) after `ping`, as an
        engine newer than its clients might. Below `MESSAGES_SINCE` it is a 404, as an engine without it."""
        if not speaks_messages("sim", parse_version("sim", self.engine_version)):
            return error(404, "Not Found")
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        n, turns = body.get("max_tokens"), body.get("messages")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(turns, list) or not turns:
            return web.json_response({"type": "error", "error": {
                "type": "invalid_request_error", "message": "`max_tokens` (from 1) and `messages` are required"}},
                status=400)
        serving = self._serving(body)
        if isinstance(serving, web.Response):
            return serving
        usage = {"input_tokens": prompt_tokens(turns), "output_tokens": n}
        mid = "msg_sim_" + uuid.uuid4().hex[:24]
        await self._enter_batch()
        self.in_flight += 1
        self.requests_total += 1
        self.prompt_tokens_total += usage["input_tokens"]
        resp: web.StreamResponse | None = None
        try:
            if not body.get("stream"):
                for _ in range(n):
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    self.generation_tokens_total += 1
                return web.json_response({"id": mid, "type": "message", "role": "assistant", "model": serving,
                                          "content": [{"type": "text", "text": "".join(map(self.token, range(n)))}],
                                          "stop_reason": "max_tokens", "stop_sequence": None, "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)

            async def event(kind: str, obj: dict) -> None:
                await resp.write(f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **obj},
                                                                                 ensure_ascii=False).encode() + b"\n\n")
            await event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": serving, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}})
            await event("ping", {})
            await event("sim_note", {"note": "an event type no client knows"})
            await event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.generation_tokens_total += 1
                await event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": self.token(i)}})
            await event("content_block_stop", {"index": 0})
            await event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                          "usage": {"output_tokens": n}})
            await event("message_stop", {})
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            log.info("the client of %s went away mid-stream", mid)
            return resp if resp is not None else web.Response(status=499)
        finally:
            self.in_flight -= 1
            self._leave_batch()

    async def _enter_batch(self) -> None:
        """Wait (in arrival order) for a place in the batch (`--max-num-seqs`); `_leave_batch` gives it back."""
        if self.seqs is None:
            return
        self.waiting += 1
        try:
            await self.seqs.acquire()
        finally:
            self.waiting -= 1

    def _leave_batch(self) -> None:
        if self.seqs is not None:
            self.seqs.release()

    async def _generate(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not isinstance(n, int) or n < 1:
            return error(400, "`max_tokens` must be a positive integer", param="max_tokens")
        k = body.get("n", 1)
        if not isinstance(k, int) or not 1 <= k <= 128:
            return error(400, "`n` must be an integer from 1 to 128", param="n")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):  # as vLLM's request model refuses it
            return error(400, "`stream_options` must be an object", param="stream_options")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):  # as vLLM refuses it
            return error(400, "`cache_salt` must be a non-empty string", param="cache_salt")
        if not isinstance(body.get("cache_prompt", True), bool):
            return error(400, "`cache_prompt` must be true or false", param="cache_prompt")
        if self.group is not None and not self.group.complete:
            return error(503, "the replica's ranks have not all joined yet", code="not_ready")
        if not self.awake.is_set():  # asleep: held until woken, as vLLM's paused scheduler holds it
            await self.awake.wait()
        serving = self._serving(body)
        if isinstance(serving, web.Response):
            return serving
        marker = {"system_fingerprint": f"lora:{serving}"} if serving != self.model else {}
        start = 0  # where in the alphabet its text begins: a continuation goes on from its prefix
        if chat:
            cont = continuation(body)
            if isinstance(cont, web.Response):
                return cont
            start = cont
        elif isinstance(body.get("prompt"), str):
            start = trailing_letters(body["prompt"])
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        prompt = body.get("messages") if chat else body.get("prompt")
        usage = {"prompt_tokens": prompt_tokens(prompt), "completion_tokens": n * k}
        usage["total_tokens"] = usage["prompt_tokens"] + n * k
        cached = 0
        if self.cache.capacity > 0:  # whole blocks, never the whole prompt (its last token is computed)
            cached = min(self.cache.lookup(salt, prompt_words(prompt), body.get("cache_prompt") is not False),
                         usage["prompt_tokens"] - 1)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        await self._enter_batch()
        self.in_flight += 1
        self.requests_total += 1
        self.prompt_tokens_total += usage["prompt_tokens"]
        resp: web.StreamResponse | None = None
        try:
            if self.group is not None:
                await self.group.step()
            await self.cache.prefill(usage["prompt_tokens"] - cached)
            if not body.get("stream"):
                for _ in range(n * k):
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    self.generation_tokens_total += 1
                text = "".join(self.token(start + i) for i in range(n))
                choices = [{"index": c, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                           if chat else {"index": c, "text": text, "finish_reason": "length"} for c in range(k)]
                return web.json_response({"id": rid, "object": obj, "created": created, "model": serving,
                                          **marker, "choices": choices, "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            for j in range(n * k):
                i, c = divmod(j, k)  # token i of choice c
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.generation_tokens_total += 1
                last = i == n - 1
                if chat:
                    delta = ({"content": self.token(start + i)} if i
                             else {"role": "assistant", "content": self.token(start + i)})
                    choice = {"index": c, "delta": delta, "finish_reason": "length" if last else None}
                else:
                    choice = {"index": c, "text": self.token(start + i), "finish_reason": "length" if last else None}
                event = {"id": rid, "object": chunk_obj, "created": created, "model": serving, **marker,
                         "choices": [choice]}
                await resp.write(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
            if (opts or {}).get("include_usage") is True:
                event = {"id": rid, "object": chunk_obj, "created": created, "model": serving, **marker,
                         "choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # the client went away mid-stream: what an engine sees every day
            log.info("the client of %s went away mid-stream", rid)
            return resp if resp is not None else web.Response(status=499)
        finally:
            self.in_flight -= 1
            self._leave_batch()


def continuation(body: dict) -> int | web.Response:
    """Where a chat's answer begins in the alphabet: 0, or with `continue_final_message: true` (and
    `add_generation_prompt: false`, as vLLM requires) after the Greek letters its final assistant message
    ends with, so that a continued answer reads as one. Refused as vLLM refuses it (400)."""
    if body.get("continue_final_message") is not True:
        return 0
    if body.get("add_generation_prompt", True) is not False:
        return error(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                     param="continue_final_message")
    last = body["messages"][-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return error(400, "`continue_final_message` needs a final message with role assistant",
                     param="continue_final_message")
    return trailing_letters(last.get("content") if isinstance(last.get("content"), str) else "")


def trailing_letters(text: str) -> int:
    """How many of `text`'s last words are the sim's own tokens: where its alphabet goes on from."""
    n = 0
    for word in reversed(text.split()):
        if word not in GREEK:
            break
        n += 1
    return n


def prompt_tokens(prompt) -> int:
    """A rough count (words) of a prompt or a message list, for `usage` (a message of content parts: the
    words of its text parts)."""
    if isinstance(prompt, list):
        return sum(max(1, len(prompt_words([m]))) if isinstance(m, dict) and isinstance(m.get("content"), list)
                   else prompt_tokens(m.get("content") if isinstance(m, dict) else m) for m in prompt) or 1
    return max(1, len(str(prompt or "").split()))


def require_key(api_key: str):
    """aiohttp middleware: 401 in the OpenAI envelope unless the request carries `Bearer <api_key>`."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            body = {"error": {"message": "missing or wrong API key", "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
            return web.json_response(body, status=401)
        return await handler(request)

    return check


def make_app(engine: SimEngine, api_key: str | None = None) -> web.Application:
    app = web.Application(middlewares=[require_key(api_key)] if api_key else [])
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_post("/v1/chat/completions", engine.chat)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_post("/v1/embeddings", engine.embeddings)
    app.router.add_post("/v1/messages", engine.messages)
    app.router.add_get("/version", engine.version)
    app.router.add_post("/sleep", engine.sleep)
    app.router.add_post("/wake_up", engine.wake_up)
    app.router.add_get("/is_sleeping", engine.is_sleeping)
    app.router.add_post("/v1/load_lora_adapter", engine.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", engine.unload_lora_adapter)
    return app


def parser(api_key_env: str | None = None) -> argparse.ArgumentParser:
    """The sim engine's flags (`api_key_env`: the default of `--api-key`, the environment's key)."""
    p = argparse.ArgumentParser(prog="llmgw-sim", description="llmgw's simulated OpenAI-compatible engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="HTTP port (rank 0 only)")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens-per-second", type=float, default=50.0, help="0 = no delay")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds before /health answers 200")
    p.add_argument("--prefix-cache-blocks", type=int, default=0,
                   help=f"blocks of 16 tokens its prefix cache holds (0 = no cache; at most {MAX_CACHED_BLOCKS})")
    p.add_argument("--prefill-tokens-per-second", type=float, default=0.0,
                   help="prompt tokens not found in the cache computed per second, one prefill at a time (0 = no delay)")
    p.add_argument("--gpu-memory-mb", type=int, default=1024, help="accelerator memory it says it holds awake")
    p.add_argument("--sleep-s", type=float, default=0.1, help="seconds a POST /sleep takes")
    p.add_argument("--wake-s", type=float, default=0.2, help="seconds a POST /wake_up takes")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="go on serving after SIGTERM, as a wedged engine does: only SIGKILL ends it")
    p.add_argument("--max-loras", type=int, default=0, help="LoRA adapters held at once (0: LoRA off)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="requests generated at once; more wait (vLLM's flag; 0: no bound)")
    p.add_argument("--lora-load-s", type=float, default=0.0, help="seconds a POST /v1/load_lora_adapter takes")
    p.add_argument("--compile-s", type=float, default=0.0,
                   help="seconds a cold start spends compiling, added to --startup-delay unless the compile cache "
                        "($LLMGW_SIM_COMPILE_DIR) holds this model's mark from an earlier start")
    p.add_argument("--engine-version", default=VERSION,
                   help="the version /version reports (an older one than 0.2.0 serves no /v1/messages)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1, help="shards in the replica (multi-node)")
    p.add_argument("--rendezvous", help="HOST:PORT on rank 0's node where the shards meet")
    p.add_argument("--token", default="", help="the replica's id; a shard with another is refused")
    p.add_argument("--join-timeout", type=float, default=600.0, help="seconds a worker waits for rank 0")
    p.add_argument("--api-key", default=api_key_env or None,
                   help="refuse requests without `Authorization: Bearer KEY` (default: $LLMGW_SIM_API_KEY)")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags out of range through `p.error` (argparse's exit 2 with the message)."""
    if not 0 <= args.prefix_cache_blocks <= MAX_CACHED_BLOCKS:
        p.error(f"--prefix-cache-blocks must be from 0 to {MAX_CACHED_BLOCKS}")
    if args.prefill_tokens_per_second < 0:
        p.error("--prefill-tokens-per-second must be 0 or more")
    if args.gpu_memory_mb < 0 or args.sleep_s < 0 or args.wake_s < 0 or not 0 <= args.compile_s <= 3600:
        p.error("--gpu-memory-mb, --sleep-s and --wake-s must be 0 or more, --compile-s from 0 to 3600")
    if not 0 <= args.max_loras <= 1024 or not 0 <= args.lora_load_s <= 3600:
        p.error("--max-loras must be from 0 to 1024 and --lora-load-s from 0 to 3600")
    if args.world_size > 1 and not args.rendezvous:
        p.error("--world-size > 1 needs --rendezvous HOST:PORT")


def main(argv: list[str] | None = None) -> None:
    p = parser(os.environ.get("LLMGW_SIM_API_KEY"))
    args = p.parse_args(argv)
    check(p, args)
    if args.rank > 0:
        asyncio.run(run_worker(args.rendezvous, args.rank, args.world_size, args.token, args.join_timeout))
        return
    if args.port is None:
        p.error("rank 0 serves HTTP: --port is required")
    asyncio.run(_serve(args))


def compiled_mark(model: str, env: dict[str, str] | None = None) -> Path | None:
    """Where a start of `model` leaves its mark once it has "compiled": in the compile cache llmgw gives it
    (`LLMGW_SIM_COMPILE_DIR` of `env`, default this process's; engines/compile_cache.py); None without one
    (every start is then cold)."""
    root = (os.environ if env is None else env).get("LLMGW_SIM_COMPILE_DIR")
    if not root:
        return None
    return Path(root) / f"sim-compiled-{hashlib.sha256(model.encode()).hexdigest()[:16]}"


def write_mark(path: Path) -> None:
    """The mark, written whole or not at all (a temporary file renamed over it), as vLLM writes its artifacts."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("compiled\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"sim: could not write the compile mark {path}: {exc}", flush=True)


def build_engine(args: argparse.Namespace, group: Group | None = None, env: dict[str, str] | None = None,
                 say=print) -> tuple[SimEngine, Path | None, float]:
    """The engine `args` describe: (engine, its compile mark or None, the seconds its cold compile adds).
    `say(line)` prints one line of its output (the process's stdout; a shared host's log: sim_shared.py)."""
    compile_mark = compiled_mark(args.model, env) if args.compile_s > 0 else None
    compile_s = args.compile_s if compile_mark is not None and not compile_mark.exists() else 0.0
    if args.compile_s > 0:
        say(f"sim: compile cache {'cold' if compile_s else 'warm'} ({compile_mark})")
    engine = SimEngine(args.model, args.tokens_per_second, args.startup_delay + compile_s, args.rank, group,
                       PrefixCache(args.prefix_cache_blocks, args.prefill_tokens_per_second), args.gpu_memory_mb,
                       args.sleep_s, args.wake_s, args.max_loras, args.lora_load_s, args.max_num_seqs)
    engine.engine_version = args.engine_version
    return engine, compile_mark, compile_s


async def _serve(args: argparse.Namespace) -> None:
    group = None
    if args.world_size > 1:
        group = Group(args.rendezvous, args.world_size, args.token)
        await group.start()
    engine, compile_mark, compile_s = build_engine(args, group, say=lambda line: print(line, flush=True))
    runner = web.AppRunner(make_app(engine, args.api_key), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    # Said as it happens, as real engines do ("Application startup complete", "server is listening"): the
    # node checks readiness when an engine's output grows (node/readiness.py).
    print(f"sim: serving {args.model} on {args.host}:{args.port}", flush=True)
    loop = asyncio.get_running_loop()
    if compile_s and compile_mark is not None:
        loop.call_later(max(0.0, engine.ready_at - time.monotonic()), write_mark, compile_mark)
    if args.startup_delay + compile_s > 0:
        loop.call_later(max(0.0, engine.ready_at - time.monotonic()), lambda: print(f"sim: {args.model} loaded, ready", flush=True))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if args.ignore_sigterm:  # said, so a test sees the stop's SIGTERM arrive
        loop.add_signal_handler(signal.SIGTERM, lambda: print("sim: ignoring SIGTERM", flush=True))
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
        # Said on the way out, so a stop that came before a drain finished is visible in the shard's log.
        print(f"sim: stopping with {engine.in_flight} request(s) in flight", flush=True)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    main()
