"""`llmgw ctl tenants create | list | set | delete` and `llmgw ctl usage` (issue 15): teams, their limits, what
they used.

Limit options take an integer (`60`, or with a suffix: `10k`, `2M`, `1G`), or `none` to remove the limit
(on `set`); `--models` a comma-separated list of model names, aliases or patterns (`llama-*,judge`);
`--weight` a number (`2`, `0.5`) and `--band` `interactive` or `batch`, the share of a saturated model's
slots (gateway/fairness.py), `none` for the default (1, interactive). What
they mean and how they are checked is the admin API's to say (schemas/tenants.py): a value it refuses is
printed as its one-line error.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from datetime import datetime
from typing import Any, Optional

import typer

from llmgw.ctl.client import Admin, confirm, fail, seg
from llmgw.ctl.output import Output, age, dump, output_option, show, table

app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown",
                  help="Tenants (teams) and their limits: create, list, set, delete.")

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?)([kKmMgGtT]?)")


def limit_value(text: str, option: str = "the limit") -> Any:
    """`60`, `10k`, `2.5M` -> an integer; `none` -> None (no limit). Anything else, or a number under 1, is
    refused here in the option's own words (the admin API refuses caps and the rest by field)."""
    if text.strip().lower() == "none":
        return None
    m = _NUMBER.fullmatch(text.strip())
    if m:
        n = Decimal(m.group(1)) * _SUFFIX[m.group(2).lower()]  # (4.1M in floats is 4099999.9999999995)
        if n == int(n) and n >= 1:
            return int(n)
        if n < 1:
            fail(f"{option} {text}: a limit is at least 1; write `{option} none` for no limit")
    fail(f"{option} {text!r} is not a whole number: write one such as 60, 10k, 2M or 1G, or `none` for no limit")


def weight_value(text: str) -> float | None:
    """`2`, `0.5` -> the number; `none` -> None (the default, 1). Its range is the admin API's to check."""
    if text.strip().lower() == "none":
        return None
    try:
        w = float(text)
    except ValueError:
        w = math.nan
    if not math.isfinite(w):
        fail(f"--weight {text!r} is not a number: write one such as 1, 2 or 0.5, or `none` for the default (1)")
    return w


def limits_body(rpm: str | None, tpm: str | None, per_day: str | None, per_month: str | None,
                models: str | None, weight: str | None = None, band: str | None = None) -> dict:
    """The `limits` object of the options given (an option not given is left out: unchanged on `set`)."""
    out: dict[str, Any] = {}
    for field, value in (("rpm", rpm), ("tpm", tpm), ("tokens_per_day", per_day), ("tokens_per_month", per_month)):
        if value is not None:
            out[field] = limit_value(value, "--" + field.replace("_", "-"))
    if models is not None:
        out["models"] = None if models.strip().lower() == "none" else models.split(",")
    if weight is not None:
        out["weight"] = weight_value(weight)
    if band is not None:
        out["band"] = None if band.strip().lower() == "none" else band
    return out


def changed_limits(rpm: str | None, tpm: str | None, per_day: str | None, per_month: str | None,
                   models: str | None, weight: str | None = None, band: str | None = None) -> dict:
    """`limits_body` for a `set`: at least one option must be given (else exit 2 saying which there are)."""
    body = limits_body(rpm, tpm, per_day, per_month, models, weight, band)
    if not body:
        typer.echo("nothing to change: give --rpm, --tpm, --tokens-per-day, --tokens-per-month, --models, --weight "
                   "or --band", err=True)
        raise typer.Exit(2)
    return body


RPM = typer.Option(None, "--rpm", help="Requests per minute, fleet-wide (`none`: no limit)")
TPM = typer.Option(None, "--tpm", help="Tokens (prompt + completion) per minute, fleet-wide (`none`: no limit)")
PER_DAY = typer.Option(None, "--tokens-per-day", help="A token budget per UTC day (`none`: no budget)")
PER_MONTH = typer.Option(None, "--tokens-per-month", help="A token budget per UTC month (`none`: no budget)")
MODELS = typer.Option(None, "--models", help="Models it may use: names, aliases or patterns, comma-separated "
                      "(`llama-*,judge`; `none`: every model)")
WEIGHT = typer.Option(None, "--weight", help="Its share of a saturated model's slots against others waiting, "
                      "0.01 to 100 (`none`: the default, 1)")
BAND = typer.Option(None, "--band", help="`interactive` (served first) or `batch` (`none`: the default, interactive)")


def limit_number(n: int | None) -> str:
    """A limit as the options take it: 20000000 -> `20M`, 10000 -> `10k`, 60 -> `60`, 2500000 -> `2500k`; None
    -> `-`. Only exact multiples take a suffix, so `limit_value` of what is shown gives the limit back."""
    if n is None:
        return "-"
    for suffix in ("T", "G", "M", "k"):
        unit = _SUFFIX[suffix.lower()]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def limits_text(limits: dict) -> str:
    """`rpm 60, tpm 10k, 1M/day, models llama-*` (or `unlimited`)."""
    parts = [f"rpm {limit_number(limits['rpm'])}"] if limits.get("rpm") else []
    if limits.get("tpm"):
        parts.append(f"tpm {limit_number(limits['tpm'])}")
    if limits.get("tokens_per_day"):
        parts.append(f"{limit_number(limits['tokens_per_day'])}/day")
    if limits.get("tokens_per_month"):
        parts.append(f"{limit_number(limits['tokens_per_month'])}/month")
    if limits.get("models") is not None:
        parts.append("models " + ",".join(limits["models"]))
    if limits.get("weight") is not None:
        parts.append(f"weight {limits['weight']:g}")
    if limits.get("band"):
        parts.append(f"band {limits['band']}")
    return ", ".join(parts) or "unlimited"


def _notes(view: dict) -> None:
    for n in view.get("notes") or []:
        typer.echo(f"note: {n}", err=True)


@app.command("create")
def create(name: str = typer.Argument(..., help="The tenant's name: lower-case letters, digits and . _ -"),
           rpm: Optional[str] = RPM, tpm: Optional[str] = TPM, tokens_per_day: Optional[str] = PER_DAY,
           tokens_per_month: Optional[str] = PER_MONTH, models: Optional[str] = MODELS,
           weight: Optional[str] = WEIGHT, band: Optional[str] = BAND):
    """Create a tenant with its limits. Its keys come from `llmgw ctl keys create --tenant NAME`."""
    view = Admin().post("/admin/v1/tenants", {"name": name, "limits": limits_body(
        rpm, tpm, tokens_per_day, tokens_per_month, models, weight, band)})
    typer.echo(f"created tenant {view['name']}: {limits_text(view['limits'])}")
    _notes(view)


@app.command("set")
def set_(name: str = typer.Argument(..., help="The tenant"), rpm: Optional[str] = RPM, tpm: Optional[str] = TPM,
         tokens_per_day: Optional[str] = PER_DAY, tokens_per_month: Optional[str] = PER_MONTH,
         models: Optional[str] = MODELS, weight: Optional[str] = WEIGHT, band: Optional[str] = BAND):
    """Change a tenant's limits: only those given (`none` removes one). Every gateway applies them within a
    moment."""
    body = changed_limits(rpm, tpm, tokens_per_day, tokens_per_month, models, weight, band)
    view = Admin().post(f"/admin/v1/tenants/{seg(name)}", {"limits": body})
    typer.echo(f"tenant {view['name']}: {limits_text(view['limits'])}")
    _notes(view)


@app.command("delete")
def delete(name: str = typer.Argument(..., help="The tenant"),
           revoke_keys: bool = typer.Option(False, "--revoke-keys", help="Revoke its active keys with it"),
           yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking")):
    """Delete a tenant. While it has active keys it is refused, naming them, unless `--revoke-keys`
    revokes them with it (every gateway refuses them within a moment). Its usage stays in `ctl usage`."""
    admin = Admin()
    found = [t for t in admin.get("/admin/v1/tenants") if t["name"] == name]
    if found:
        t = found[0]
        typer.echo(f"  {t['name']}  {limits_text(t['limits'])}  {t['keys']} active key(s)")
        if t["keys"] and revoke_keys:
            typer.echo(f"  its {t['keys']} active key(s) are revoked with it")
    # With active keys and no --revoke-keys the server refuses, naming them: say so without asking first.
    if found and not (found[0]["keys"] and not revoke_keys) and not yes and not confirm("delete?"):
        raise typer.Exit(1)
    done = admin.delete(f"/admin/v1/tenants/{seg(name)}", revoke_keys=str(revoke_keys).lower())
    typer.echo(f"deleted tenant {done['name']}" + (f"; revoked {', '.join(done['revoked'])}" if done["revoked"] else ""))


def _tenants_table(tenants: list[dict], now: datetime, wide: bool):
    cols = ["NAME", "RPM", "TPM", "TOKENS/DAY", "TOKENS/MONTH", "MODELS", "WEIGHT", "BAND", "KEYS", "AGE"]
    if wide:
        cols += ["CREATED", "UPDATED"]
    rows = []
    for t in tenants:
        lim = t["limits"]
        row = [t["name"], *(limit_number(lim.get(f)) for f in ("rpm", "tpm", "tokens_per_day", "tokens_per_month")),
               ",".join(lim["models"]) if lim.get("models") else "*",
               f"{lim['weight']:g}" if lim.get("weight") is not None else "1", lim.get("band") or "interactive",
               t["keys"], age(t["created_at"], now)]
        if wide:
            row += [t["created_at"], t["updated_at"]]
        rows.append(row)
    return table(cols, rows)


@app.command("list")
def list_tenants(output: Output = output_option()):
    """Every tenant: its limits (`-`: none; MODELS `*`: every model), its share of a saturated model (WEIGHT,
    BAND), active keys, age."""
    admin = Admin()
    show(lambda: (admin.get("/admin/v1/tenants"), admin.now), _tenants_table, output,
         empty="no tenants; `llmgw ctl tenants create NAME --rpm 60` makes one")


# ---- usage --------------------------------------------------------------------------------------

def _usage_table(report: dict, now: datetime, wide: bool):
    by = report["by"]
    group = {"model": ["MODEL"], "key": ["KEY", "NAME"], "day": ["DAY"], "tenant": []}[by]
    cols = ["TENANT", *group, "REQUESTS", "PROMPT", "COMPLETION", "TOTAL", "LAST USE"]
    rows = []
    for r in report["rows"]:
        g = {"model": [r["model"]], "key": [r["key_id"], r["key_name"] or "-"], "day": [r["day"]], "tenant": []}[by]
        rows.append([r["tenant"], *g, r["requests"], r["prompt_tokens"], r["completion_tokens"], r["total_tokens"],
                     f"{age(r['last_at'], now)} ago" if r["last_at"] else "-"])
    return table(cols, rows)


def usage(tenant: Optional[str] = typer.Option(None, "--tenant", help="Only this tenant (`-`: keys of no tenant)"),
          since: str = typer.Option("7d", "--since", help="How far back: 30m, 24h, 7d (at most 400d)"),
          by: str = typer.Option("tenant", "--by", help="Group by tenant (default), model, key or day (UTC)"),
          output: Output = output_option()):
    """Tokens and requests of accounted keys (those of a tenant, or with limits), as the engines reported
    them: per tenant, and per model, key or day."""
    admin = Admin()
    params: dict[str, str] = {"since": since, "by": by}
    if tenant is not None:
        params["tenant"] = tenant
    report = admin.get("/admin/v1/usage", **params)
    if output in (Output.json, Output.yaml):
        typer.echo(dump(report, output))
        return
    show(lambda: (report, admin.now), _usage_table, output)
    if not report["rows"]:
        typer.echo(f"no use in the last {since}: only keys of a tenant, or with limits, are counted", err=True)
