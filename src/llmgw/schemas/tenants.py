"""Tenants and limits as the admin API takes them (issue 15): who a key belongs to and what it may spend.

A tenant is a team; its API keys share its limits, and a key may carry limits of its own on top (both
apply: a key never gets more than its tenant). Every limit is optional (null: none):

- `rpm`, `tpm`: requests and tokens per minute, fleet-wide (every gateway counts against the same minute);
- `tokens_per_day`, `tokens_per_month`: budgets of tokens (prompt + completion) per UTC day and month;
- `models`: the models it may use: catalog names or aliases, or glob patterns over them (`llama-*`,
  `team-?/[ab]*`); null means every model;
- `weight`, `band`: its share when a model is saturated and requests wait for a slot (gateway/fairness.py):
  weighted fair queuing by tokens, `weight` from `MIN_WEIGHT` to `MAX_WEIGHT` (null: 1), inside a priority
  `band`, `interactive` (null: the default) or `batch`.

Every input is bounded and refused with the field named rather than repaired: integers only (no `1.5`,
`"10"` or `true`), from 1 to a ceiling no fleet reaches (`MAX_RPM`, `MAX_TPM`, `MAX_TOKENS`), at most
`MAX_PATTERNS` patterns of the characters model names use plus `* ? [ ] !`, with balanced, non-empty sets.
Tenant names are `TENANT_NAME_RE`; a name that would only match once lower-cased or normalised (`Team`,
`ｔｅａｍ`, ` team`) is refused with the name it would have to be, never silently rewritten, so the name an
operator typed is the name stored, counted and shown.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
import unicodedata
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from llmgw.schemas.catalog import Model

TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_TENANTS = 10_000  # the gateway holds them all in memory and labels metrics with their names
MAX_RPM = 10_000_000  # ~170,000 requests a second
MAX_TPM = 100_000_000_000
MAX_TOKENS = 1_000_000_000_000_000  # a budget; sums stay far inside Postgres' bigint
MAX_PATTERNS = 64
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0  # shares a thousand times apart at most: a sane fleet needs far less
MAX_PATTERN_LEN = 256
_PATTERN_CHARS = re.compile(r"[A-Za-z0-9._:/@+\-*?\[\]!]+")

Rpm = Annotated[int, Field(strict=True, ge=1, le=MAX_RPM)]
Tpm = Annotated[int, Field(strict=True, ge=1, le=MAX_TPM)]
Tokens = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]
Weight = Annotated[float, Field(strict=True, ge=MIN_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False)]
Band = Literal["interactive", "batch"]


def tenant_name_problem(name: object) -> str | None:
    """Why `name` cannot name a tenant, or None when it can."""
    if not isinstance(name, str):
        return "a tenant name is a string"
    if TENANT_NAME_RE.fullmatch(name):
        return None
    rule = ("tenant names are 1-63 characters: lower-case letters, digits and . _ -, starting with a letter or "
            "digit")
    canonical = unicodedata.normalize("NFKC", name).strip().lower()
    if canonical != name and TENANT_NAME_RE.fullmatch(canonical):
        return f"{rule}; {name!r} is not written that way: write {canonical!r}"
    return f"{rule} (got {name[:80]!r})"


MAX_KEY_NAME_LEN = 200


def key_name_problem(name: object) -> str | None:
    """Why `name` cannot name an API key, or None. A key's name is free text saying whose it is, printed by
    `ctl keys list` and `ctl usage --by key`: no control or format characters (line breaks, terminal
    escapes, bidirectional overrides, zero-width characters) that would rewrite what an operator's terminal
    shows, no spaces around it, at most 200 characters, written in NFC (a name that normalises to another is
    refused with that other)."""
    if not isinstance(name, str):
        return "a key name is a string"
    if len(name) > MAX_KEY_NAME_LEN:
        return f"a key name is at most {MAX_KEY_NAME_LEN} characters (got {len(name)})"
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        return (f"a key name is plain text: it may not hold the control or format character U+{ord(bad):04X} "
                f"(got {name[:80]!r})")
    if name != name.strip():
        return f"a key name has no spaces around it: write {name.strip()!r}"
    if unicodedata.normalize("NFC", name) != name:
        return f"{name[:80]!r} is not written in NFC: write {unicodedata.normalize('NFC', name)!r}"
    return None


def _refusing(problem):
    """A validator that refuses what `problem` finds fault with, in its words (the API names the field)."""
    def check(value):
        why = problem(value)
        if why:
            raise ValueError(why)
        return value
    return AfterValidator(check)


TenantName = Annotated[str, Field(max_length=200), _refusing(tenant_name_problem)]
KeyName = Annotated[str, Field(max_length=MAX_KEY_NAME_LEN), _refusing(key_name_problem)]


def pattern_problem(pattern: object) -> str | None:
    """Why `pattern` is not a model pattern, or None. Patterns are `fnmatch` globs over model names:
    `*`, `?` and sets `[abc]`, `[!abc]`, `[a-z]`; sets are closed, not nested and not empty."""
    if not isinstance(pattern, str) or not pattern:
        return "a model pattern is a non-empty string"
    if len(pattern) > MAX_PATTERN_LEN:
        return f"a model pattern is at most {MAX_PATTERN_LEN} characters"
    if not _PATTERN_CHARS.fullmatch(pattern):
        return (f"{pattern[:80]!r}: use the characters of model names (letters, digits and . _ : / @ + -) and the "
                "wildcards * ? [...]")
    start = -1
    for i, c in enumerate(pattern):
        if c == "[":
            if start >= 0:
                return f"{pattern!r}: a `[` inside a set (sets do not nest)"
            start = i
        elif c == "]":
            if start < 0:
                return f"{pattern!r}: a `]` without its `[`"
            if i == start + 1 or (i == start + 2 and pattern[start + 1] == "!"):
                return f"{pattern!r}: an empty set `[]`"
            start = -1
        elif c == "!" and not (start >= 0 and i == start + 1):
            return f"{pattern!r}: `!` is only allowed first in a set (`[!abc]`)"
    if start >= 0:
        return f"{pattern!r}: a `[` that is never closed"
    return None


class Limits(BaseModel):
    """What a tenant, or one key, may spend. Every field optional; null (or absent) is no limit.

    As an update (`ctl tenants set`, `ctl keys set`) only the fields sent change, and null removes one.
    """

    model_config = ConfigDict(extra="forbid")

    rpm: Rpm | None = None
    tpm: Tpm | None = None
    tokens_per_day: Tokens | None = None
    tokens_per_month: Tokens | None = None
    models: list[str] | None = Field(None, max_length=MAX_PATTERNS)
    weight: Weight | None = None
    band: Band | None = None

    @field_validator("models")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("an empty list would allow no model: give at least one name or pattern, or null for "
                             "every model")
        for i, p in enumerate(v):
            why = pattern_problem(p)
            if why:
                raise ValueError(f"[{i}] {why}")
        return v

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in type(self).model_fields)

    def updated(self, change: "Limits") -> "Limits":
        """These limits with the fields `change` was given replaced (null removes a limit)."""
        return self.model_copy(update={f: getattr(change, f) for f in change.model_fields_set})

    def stored(self) -> dict:
        """The JSON kept in the database: only the limits that are set."""
        return self.model_dump(exclude_none=True)


class TenantCreate(BaseModel):
    """Admin API: create a tenant."""

    model_config = ConfigDict(extra="forbid")

    name: TenantName
    limits: Limits = Field(default_factory=Limits)


class LimitsChange(BaseModel):
    """Admin API: change a tenant's or a key's limits (only the fields given; null removes one)."""

    model_config = ConfigDict(extra="forbid")

    limits: Limits


class TenantView(BaseModel):
    """A tenant as listed: its limits and how many active keys it has. `notes` (on create and set) names
    the patterns that match no model of the catalog now."""

    name: str
    limits: Limits
    keys: int = 0
    created_at: datetime
    updated_at: datetime
    notes: list[str] = Field(default_factory=list)


class TenantDeleted(BaseModel):
    """A tenant deleted, and the ids of the keys revoked with it (`revoke_keys`)."""

    name: str
    revoked: list[str] = Field(default_factory=list)


USAGE_BY = ("tenant", "model", "key", "day")


class UsageRow(BaseModel):
    """Tokens and requests of one group (`by`): a tenant (`-` for keys of no tenant), and the model, the
    key or the UTC day. `last_at`: the latest minute with use in the group."""

    tenant: str
    model: str | None = None
    key_id: str | None = None
    key_name: str | None = None
    day: str | None = None
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    last_at: datetime | None = None


class UsageReport(BaseModel):
    """`ctl usage`: use from `since` until `until` (the database clock), grouped `by`."""

    since: datetime
    until: datetime
    by: str
    tenant: str | None = None
    rows: list[UsageRow] = Field(default_factory=list)


NO_TENANT = "-"  # the tenant label, and what `ctl usage` shows, for a key of no tenant


def model_allowed(patterns: list[str], model: "Model") -> bool:
    """Whether a pattern matches the model's name or one of its aliases (so a pattern may name either)."""
    return any(fnmatchcase(n, p) for p in patterns for n in (model.name, *model.aliases))
