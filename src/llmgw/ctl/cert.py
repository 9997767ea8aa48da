"""`llmgw ctl cert ca | server | node`: llmgw's private CA and the node API's mutual-TLS certificates.
Local files only: these never talk to the admin API."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmgw.config import Settings
from llmgw.ctl.client import fail

app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown",
                  help="llmgw's private CA and the node API's mutual-TLS certificates.")


def _pki_dir(directory: Optional[Path]) -> Path:
    return directory or Settings().state_dir / "pki"


@app.command("ca")
def ca(directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write ca.crt/ca.key (default <state>/pki)")):
    """Create the CA and the key that signs node activities. ca.key and activity-signing.key stay on the control
    plane; ca.crt and activity-signing.pub go to every node."""
    from llmgw.security.pki import create_ca

    try:
        out = create_ca(_pki_dir(directory))
    except (FileExistsError, OSError) as exc:
        fail(f"error: {exc}", 2)
    typer.echo(f"{out.cert}\n{out.key}  (keep this key on the control plane only)\n"
               f"{out.cert.parent / 'activity-signing.pub'}\n"
               f"{out.cert.parent / 'activity-signing.key'}  (the control workers' only: it signs node activities)")


@app.command("activity-key")
def activity_key(directory: Optional[Path] = typer.Option(None, "--dir", help="Where the CA is (default <state>/pki)")):
    """Make the key that signs node activities beside the CA, if it is not there yet (`ca` makes it too; this
    is for a CA made before). activity-signing.key stays on the control plane; .pub goes to every node."""
    from llmgw.security.activity_origin import create_signing_key

    try:
        key, pub = create_signing_key(_pki_dir(directory))
    except OSError as exc:
        fail(f"error: {exc}", 2)
    typer.echo(f"{pub}\n{key}  (the control workers' only: it signs node activities)")


@app.command("server")
def server(
    host: list[str] = typer.Option(..., "--host", help="A DNS name or IP address agents dial; repeat for each"),
    directory: Optional[Path] = typer.Option(None, "--dir"),
    force: bool = typer.Option(False, "--force", help="Replace an existing server certificate and key"),
):
    """Issue the node API's server certificate for every --host (set LLMGW_NODE_API_CERT/KEY to it)."""
    from llmgw.security.pki import issue_server

    try:
        out = issue_server(_pki_dir(directory), host, replace=force)
    except (ValueError, OSError) as exc:
        fail(f"error: {exc}", 2)
    typer.echo(f"{out.cert}\n{out.key}")


@app.command("node")
def node(
    node_id: str,
    directory: Optional[Path] = typer.Option(None, "--dir"),
    address: list[str] = typer.Option([], "--address", help="An address (IP or DNS name) the node's engines listen "
                                      "on, when it is not the one the node reaches the control plane from; repeatable"),
    force: bool = typer.Option(False, "--force", help="Replace the node's existing certificate and key"),
):
    """Issue a node's client certificate (common name = NODE_ID); copy it and ca.crt to the node."""
    from llmgw.security.pki import issue_node

    try:
        out = issue_node(_pki_dir(directory), node_id, addresses=address, replace=force)
    except (ValueError, OSError) as exc:
        fail(f"error: {exc}", 2)
    typer.echo(f"{out.cert}\n{out.key}")
