"""`llmgw ctl apply -f FILE` and `llmgw ctl catalog`: the live catalog out as YAML, and back in.

`ctl catalog > c.yaml`, edit, `ctl apply -f c.yaml` round-trips: what `catalog` prints is what the
control plane stores (after the upgrade repairs, without fields left at their defaults), so applying it
unchanged says "no changes".
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmgw.ctl.client import Admin, confirm, fail
from llmgw.ctl.output import Output, console, dump


def register(app: typer.Typer) -> None:
    app.command("apply")(apply)
    app.command("catalog")(catalog)


def apply(
    file: Path = typer.Option(..., "-f", "--file", help="Catalog YAML"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Apply without asking"),
):
    """Apply a catalog file: show what changes (and what the upgrade repaired), then apply.

    Asks first unless --yes. The file replaces the whole catalog.
    """
    from llmgw.catalog.loader import CatalogError, parse_catalog, read_yaml

    if not file.is_file():
        fail(f"error: {file}: no such file; give the catalog YAML with -f", 2)
    try:
        raw = read_yaml(file)
        if raw is None:  # an empty file (a redirect that failed, say) must not read as "remove every model"
            fail(f"error: {file} is empty (or only comments); write `models: [...]`, or `models: []` to remove "
                 "every model", 2)
        parse_catalog(raw)  # refuse locally first, with the same errors the server gives
    except OSError as exc:
        fail(f"error: {file}: {exc}", 2)
    except CatalogError as exc:
        fail(str(exc), 2)
    admin = Admin()
    diff = admin.post("/admin/v1/catalog", {"catalog": raw, "dry_run": True})
    for note in diff.get("notes", []):
        typer.echo(f"  repaired: {note}")
    for warning in diff.get("warnings", []):
        typer.echo(f"  note: {warning}")
    for k, sign in (("added", "+"), ("changed", "~"), ("removed", "-")):
        for n in diff[k]:
            typer.echo(f"  {sign} {n}")
            for line in diff.get("changes", {}).get(n, []):
                typer.echo(f"      {line}")
    if not (diff["added"] or diff["changed"] or diff["removed"]):
        typer.echo("no changes")
        return
    if not yes and not confirm("apply?"):
        fail("not applied")
    admin.post("/admin/v1/catalog", {"catalog": raw})
    typer.echo("applied")


def catalog(output: Output = typer.Option(Output.yaml, "--output", "-o", help="yaml (default) or json",
                                          case_sensitive=False)):
    """The live catalog as YAML: `ctl catalog > c.yaml`, edit, `ctl apply -f c.yaml`."""
    admin = Admin()
    data = admin.get("/admin/v1/catalog")
    # Stored models this version cannot read are not in it: applying it would remove them (and stop their
    # replicas), so they are named, on stderr for JSON and as comments in the YAML.
    unreadable = [m for m in admin.get("/admin/v1/models") if m.get("status") == "unreadable"]
    lost = [f"# NOT IN THIS FILE: {m['name']}: {m['reason']}" for m in unreadable]
    if output == Output.json:
        for line in lost:
            typer.echo(line.removeprefix("# "), err=True)
        console().print(dump(data, Output.json), markup=False)
        return
    if output != Output.yaml:
        fail("error: ctl catalog prints yaml or json (-o yaml, -o json)", 2)
    head = (f"# The live catalog at {admin.url}, {admin.now.astimezone().strftime('%Y-%m-%d %H:%M:%S %Z')}.\n"
            "# Edit and apply it whole: llmgw ctl apply -f <this file> (models left out are removed).\n"
            + "".join(" ".join(line.split()) + "\n" for line in lost))
    typer.echo(head + dump(data, Output.yaml), nl=False)
