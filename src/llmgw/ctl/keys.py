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
           weight: Optional[str] = WEIGHT, band: Optional[str] = BAND,
           yes: bool = typer.Option(False, "--yes", "-y", help="Create it even if active keys carry the name")):
    """Create an API key and print it. It is shown only now: only its hash is stored. With `--tenant` (or
    limits of its own) its use is counted and limited; without, it is unlimited. A name other active keys
    carry is asked about first (`--yes` to go ahead)."""
    body: dict = {"name": name, "limits": limits_body(rpm, tpm, tokens_per_day, tokens_per_month, models, weight,
                                                      band)}
    if tenant is not None:
        body["tenant"] = tenant
    admin = Admin()
    if name:
        others = namesakes(admin, name)
        if others and not yes and not confirm(
                f"{len(others)} active key(s) are already named {name!r}: {listed(others, admin.now)}. "
                "Create another under the same name (to rotate a key: create, move the clients, revoke the old)?"):
            raise typer.Exit(1)
    k = admin.post("/admin/v1/keys", body)
    typer.echo(k["key"])
    owner = f", tenant {k['tenant']}" if k.get("tenant") else ""
    typer.echo(f"created key {k['id']}{' (' + k['name'] + ')' if k['name'] else ''}{owner}; it cannot be shown again. "
               "Once any key exists the gateway requires one (see docs/gateway.md).", err=True)
    if name and others:
        typer.echo(f"note: {len(others)} other active key(s) are also named {name!r}. All of them work; to "
                   "replace one, revoke it by id: `llmgw ctl keys revoke ID`.", err=True)


def namesakes(admin: Admin, name: str) -> list[dict]:
    """The active keys named `name`. Names are free text and need not be unique (a key is rotated by creating
    its successor under the same name, then revoking the old one), so a second key of a name is asked about,
    and the two are told apart by id in `ctl keys list` before one is revoked."""
    return [k for k in admin.get("/admin/v1/keys") if k["name"] == name and not k["revoked_at"]]


def listed(keys: list[dict], now: datetime) -> str:
    """Keys by id, first characters and age: up to five, the rest counted."""
    text = ", ".join(f"{k['id']} ({k['prefix']}..., created {age(k['created_at'], now)} ago)"
                     for k in keys[:NAMESAKES_SHOWN])
    if len(keys) > NAMESAKES_SHOWN:
        text += f" and {len(keys) - NAMESAKES_SHOWN} more (`llmgw ctl keys list`)"
    return text


def resolve(admin: Admin, ref: str, command: str) -> dict:
    """The key `ref` names: its id, or a prefix of exactly one key's id (as git takes commits). A name is
    not taken (names need not be unique): it is answered with the ids to use."""
    keys = admin.get("/admin/v1/keys")
    exact = [k for k in keys if k["id"] == ref]
    if exact:
        return exact[0]
    by_prefix = [k for k in keys if ref and k["id"].startswith(ref)]
    if len(by_prefix) == 1:
        return by_prefix[0]
    if len(by_prefix) > 1:
        fail(f"{ref!r} is the start of {len(by_prefix)} key ids ({', '.join(k['id'] for k in by_prefix[:8])}"
             f"{', ...' if len(by_prefix) > 8 else ''}); give more of the id")
    named = [k["id"] for k in keys if k["name"] == ref and not k["revoked_at"]]
    if named:  # a name: say its id (names need not be unique, so the id is what revoke takes)
        ids = " or ".join(named)
        fail(f"no API key with id {ref!r}, but {len(named)} active key(s) named so: {command} by id "
             f"(`llmgw ctl keys {command} {named[0]}`{'; ids: ' + ids if len(named) > 1 else ''})")
    fail(f"no API key with id {ref!r}; `llmgw ctl keys list` shows them")


@app.command("set")
def set_(key_id: str = typer.Argument(..., help="The key's id, or its first characters if no other id starts so"),
         rpm: Optional[str] = RPM, tpm: Optional[str] = TPM, tokens_per_day: Optional[str] = PER_DAY,
         tokens_per_month: Optional[str] = PER_MONTH, models: Optional[str] = MODELS,
         weight: Optional[str] = WEIGHT, band: Optional[str] = BAND):
    """Change a key's own limits (on top of its tenant's): only those given (`none` removes one). A key's
    `--weight` and `--band` can only lower its tenant's share (the smaller weight, `batch` if either says it)."""
    body = changed_limits(rpm, tpm, tokens_per_day, tokens_per_month, models, weight, band)
    admin = Admin()
    key_id = resolve(admin, key_id, "set")["id"]
    k = admin.post(f"/admin/v1/keys/{seg(key_id)}", {"limits": body})
    typer.echo(f"key {k['id']}: {limits_text(k['limits'])}")


def own_limits_text(k: dict) -> str:
    """A key's own limits; with none, what binds it: its tenant's (`ctl tenants list`) or nothing."""
    own = k.get("limits") or {}
    if any(v is not None for v in own.values()):
        return limits_text(own)
    return f"none: tenant {k['tenant']}'s limits apply" if k.get("tenant") else "unlimited"


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
def revoke(key_id: str = typer.Argument(..., help="The key's id, or its first characters if no other id starts so"),
           yes: bool = typer.Option(False, "--yes", "-y", help="Revoke without asking")):
    """Revoke a key by id. Every gateway refuses it within a moment (they are notified)."""
    admin = Admin()
    k = resolve(admin, key_id, "revoke")
    typer.echo(f"  {k['id']}  {k['prefix']}...  {k['name'] or '-'}")
    if not yes and not confirm("revoke?"):
        raise typer.Exit(1)
    admin.post(f"/admin/v1/keys/{seg(k['id'])}/revoke", {})
    typer.echo("revoked")
