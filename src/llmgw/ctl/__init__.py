"""`llmgw ctl`: operate a running control plane through its admin API, with kubectl's habits (headers and
AGE on every table; `-o table|wide|json|yaml` on every listing; `--watch`; one clear line and exit status 1
for every expected failure, never a traceback)."""

from __future__ import annotations

import typer

from llmgw.ctl import catalog, cert, fleet, keys, reclaim, tenants

ctl_app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown",
                      help="Operate a running control plane through its admin API.")
fleet.register(ctl_app)
catalog.register(ctl_app)
reclaim.register(ctl_app)
ctl_app.add_typer(cert.app, name="cert")
ctl_app.add_typer(keys.app, name="keys")
ctl_app.add_typer(tenants.app, name="tenants")
ctl_app.command("usage")(tenants.usage)
