"""`llmgw ctl keys create | list | revoke`: gateway API keys."""

from __future__ import annotations

from datetime import datetime

import typer

from llmgw.ctl.client import Admin, fail
from llmgw.ctl.output import Output, age, output_option, show, table

app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown", help="Gateway API keys: create, list, revoke.")


@app.command("create")
def create(name: str = typer.Option("", "--name", help="Whose key this is (free text)")):
    """Create an API key and print it. It is shown only now: only its hash is stored."""
    k = Admin().post("/admin/v1/keys", {"name": name})
    typer.echo(k["key"])
    typer.echo(f"created key {k['id']}{' (' + k['name'] + ')' if k['name'] else ''}; it cannot be shown again. "
               "Once any key exists the gateway requires one (see docs/gateway.md).", err=True)


def _keys_table(keys: list[dict], now: datetime, wide: bool):
    cols = ["ID", "PREFIX", "NAME", "STATUS", "AGE"]
    if wide:
        cols += ["CREATED", "REVOKED"]
    rows = []
    for k in keys:
        state = f"revoked {age(k['revoked_at'], now)} ago" if k["revoked_at"] else "active"
        row = [k["id"], k["prefix"] + "...", k["name"] or "-", state, age(k["created_at"], now)]
        if wide:
            row += [k["created_at"], k["revoked_at"] or "-"]
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
    match = [k for k in admin.get("/admin/v1/keys") if k["id"] == key_id]
    if not match:
        fail(f"no API key with id {key_id!r}; `llmgw ctl keys list` shows them")
    k = match[0]
    typer.echo(f"  {k['id']}  {k['prefix']}...  {k['name'] or '-'}")
    if not yes and not typer.confirm("revoke?"):
        raise typer.Exit(1)
    admin.post(f"/admin/v1/keys/{key_id}/revoke", {})
    typer.echo("revoked")
