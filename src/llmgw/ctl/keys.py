"""`llmgw ctl keys create | list | set | revoke`: gateway API keys, their tenant and their own limits."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

import typer

from llmgw.ctl.client import Admin, confirm, fail, seg
from llmgw.ctl.output import Output, age, output_option, show, table
from llmgw.ctl.tenants import (
    BAND, MODELS, PER_DAY, PER_MONTH, RPM, TPM, WEIGHT, changed_limits, limits_body, limits_text,
)

NAMESAKES_SHOWN = 5  # namesakes named one by one after a create; the rest are counted

app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown",
                  help="Gateway API keys: create, list, set limits, revoke.")


@app.command("create")
def create(name: str = typer.Option("", "--name", help="Whose key this is (free text)"),
           tenant: Optional[str] = typer.Option(None, "--tenant", help="The tenant it belongs to (its limits apply)"),
           rpm: Optional[str] = RPM, tpm: Optional[str] = TPM, tokens_per_day: Optional[str] = PER_DAY,
           tokens_per_month: Optional[str] = PER_MONTH, models: Optional[str] = MODELS,
           weight: Optional[str] = WEIGHT, band: Optional[str] = BAND):
    """Create an API key and print it. It is shown only now: only its hash is stored. With `--tenant` (or
    limits of its own) its use is counted and limited; without, it is unlimited."""
    body: dict = {"name": name, "limits": limits_body(rpm, tpm, tokens_per_day, tokens_per_month, models, weight,
                                                      band)}
    if tenant is not None:
        body["tenant"] = tenant
    admin = Admin()
    k = admin.post("/admin/v1/keys", body)
    typer.echo(k["key"])
    owner = f", tenant {k['tenant']}" if k.get("tenant") else ""
    typer.echo(f"created key {k['id']}{' (' + k['name'] + ')' if k['name'] else ''}{owner}; it cannot be shown again. "
               "Once any key exists the gateway requires one (see docs/gateway.md).", err=True)
    if name:
        namesakes(admin, k)


def namesakes(admin: Admin, created: dict) -> None:
    """Say which other active keys carry the new key's name. Names are free text and need not be unique
    (a key is rotated by creating its successor under the same name, then revoking the old one), but two
    keys that look alike in `ctl keys list` should be told apart by id before one is revoked."""
    others = [k for k in admin.get("/admin/v1/keys")
              if k["name"] == created["name"] and k["id"] != created["id"] and not k["revoked_at"]]
    if not others:
        return
    now = admin.now
    listed = ", ".join(f"{k['id']} ({k['prefix']}..., created {age(k['created_at'], now)} ago)"
                       for k in others[:NAMESAKES_SHOWN])
    if len(others) > NAMESAKES_SHOWN:
        listed += f" and {len(others) - NAMESAKES_SHOWN} more (`llmgw ctl keys list`)"
    typer.echo(f"note: {len(others)} other active key(s) are also named {created['name']!r}: {listed}. All of them "
               "work; to replace one, revoke it by id: `llmgw ctl keys revoke ID`.", err=True)


@app.command("set")
def set_(key_id: str, rpm: Optional[str] = RPM, tpm: Optional[str] = TPM, tokens_per_day: Optional[str] = PER_DAY,
         tokens_per_month: Optional[str] = PER_MONTH, models: Optional[str] = MODELS,
         weight: Optional[str] = WEIGHT, band: Optional[str] = BAND):
    """Change a key's own limits (on top of its tenant's): only those given (`none` removes one). A key's
    `--weight` and `--band` can only lower its tenant's share (the smaller weight, `batch` if either says it)."""
    body = changed_limits(rpm, tpm, tokens_per_day, tokens_per_month, models, weight, band)
    k = Admin().post(f"/admin/v1/keys/{seg(key_id)}", {"limits": body})
    typer.echo(f"key {k['id']}: {limits_text(k['limits'])}")


def own_limits_text(k: dict) -> str:
    """A key's own limits; with none, what binds it: its tenant's (`ctl tenants list`) or nothing."""
    own = k.get("limits") or {}
    if any(v is not None for v in own.values()):
        return limits_text(own)
    return f"none (tenant {k['tenant']}'s apply)" if k.get("tenant") else "unlimited"


def _keys_table(keys: list[dict], now: datetime, wide: bool):
    cols = ["ID", "PREFIX", "NAME", "TENANT", "STATUS", "AGE"]
    if wide:
        cols += ["OWN LIMITS", "CREATED", "REVOKED"]
    rows = []
    for k in keys:
        state = f"revoked {age(k['revoked_at'], now)} ago" if k["revoked_at"] else "active"
        row = [k["id"], k["prefix"] + "...", k["name"] or "-", k.get("tenant") or "-", state, age(k["created_at"], now)]
        if wide:
            row += [own_limits_text(k), k["created_at"], k["revoked_at"] or "-"]
        rows.append(row)
    return table(cols, rows)


@app.command("list")
def list_keys(output: Output = output_option()):
    """Every API key: id, first characters, name, active or revoked, age. Never the key itself."""
    admin = Admin()
    show(lambda: (admin.get("/admin/v1/keys"), admin.now), _keys_table, output,
         empty="no API keys: the gateway needs none until one is created (`llmgw ctl keys create --name NAME`)")


@app.command("revoke")
def revoke(key_id: str, yes: bool = typer.Option(False, "--yes", "-y", help="Revoke without asking")):
    """Revoke a key by id. Every gateway refuses it within a moment (they are notified)."""
    admin = Admin()
    keys = admin.get("/admin/v1/keys")
    match = [k for k in keys if k["id"] == key_id]
    if not match:
        named = [k["id"] for k in keys if k["name"] == key_id and not k["revoked_at"]]
        if named:  # a name: say its id (names need not be unique, so the id is what revoke takes)
            ids = " or ".join(named)
            fail(f"no API key with id {key_id!r}, but {len(named)} active key(s) named so: revoke by id "
                 f"(`llmgw ctl keys revoke {named[0]}`{'; ids: ' + ids if len(named) > 1 else ''})")
        fail(f"no API key with id {key_id!r}; `llmgw ctl keys list` shows them")
    k = match[0]
    typer.echo(f"  {k['id']}  {k['prefix']}...  {k['name'] or '-'}")
    if not yes and not confirm("revoke?"):
        raise typer.Exit(1)
    admin.post(f"/admin/v1/keys/{seg(key_id)}/revoke", {})
    typer.echo("revoked")
