"""`llmgw ctl reclaim [--collect]`: cached weights llmgw fetched that the catalog no longer wants."""

from __future__ import annotations

from datetime import datetime, timezone

import typer

from llmgw.ctl.client import Admin
from llmgw.ctl.output import Output, age, output_option, show, table


def register(app: typer.Typer) -> None:
    app.command("reclaim")(reclaim)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _reclaim_table(out: dict, now: datetime, wide: bool):
    cols = ["NODE", "ENTRY", "SIZE", "AGE", "STATE"]
    rows = []
    for n in out["nodes"]:
        info = {e["name"]: e for e in n.get("entries", [])}
        for name in n["unwanted"] + n["kept_in_use"] + (n["ignored"] if wide else []):
            e = info.get(name)
            if name in n["removed"]:
                state = "removed"
            elif name in n["unwanted"]:
                state = "unwanted"
            elif name in n["kept_in_use"]:
                state = "in use (kept)"
            else:
                state = "not llmgw's (never touched)"
            modified = datetime.fromtimestamp(e["modified_at"], timezone.utc) if e else None
            rows.append([n["node_id"], name, _mb(e["bytes"]) if e else "-", age(modified, now), state])
    for node in out["unreachable"]:
        rows.append([node, "-", "-", "-", "did not answer"])
    return table(cols, rows)


def reclaim(collect: bool = typer.Option(False, "--collect", help="Ask each node to delete what it lists"),
            output: Output = output_option()):
    """Cached weights the catalog no longer wants: list them, or delete them with --collect.

    Only files named like something llmgw fetched are considered; each node re-checks every path itself.
    `-o wide` also lists what is in the cache but not llmgw's (never touched).
    """
    admin = Admin(timeout_s=600)
    result: dict = {}

    def fetch():
        result.update(admin.post("/admin/v1/reclaim", {"collect": collect}))
        return result, admin.now

    show(fetch, _reclaim_table, output)
    if output in (Output.json, Output.yaml):
        return
    unwanted = sum(len(n["unwanted"]) for n in result["nodes"])
    if collect:
        removed = sum(len(n["removed"]) for n in result["nodes"])
        freed = sum(n["freed_mb"] for n in result["nodes"])
        typer.echo(f"removed {removed} of {unwanted} unwanted entries ({freed} MiB freed)", err=True)
    elif unwanted:
        typer.echo(f"{unwanted} unwanted entries; nothing was deleted: run again with --collect to ask the nodes "
                   "to delete them", err=True)
    else:
        typer.echo("nothing to reclaim: every cached entry llmgw fetched is still wanted", err=True)
