"""`llmgw ctl cert ca | server | node | revoke | revoked`: llmgw's private CA and the node API's mutual-TLS
certificates. `ca`, `server` and `node` write local files only; `revoke` and `revoked` use the admin API (the
deny-list is in Postgres, read by every node-API process: control/revocations.py)."""

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
    """Create the CA, the key that signs node activities and the key that encrypts Temporal payloads. ca.key and
    activity-signing.key stay on the control plane; ca.crt and activity-signing.pub go to every node;
    payload.key to every llmgw process (nodes, gateways, control and mirror workers, ctl)."""
    from llmgw.security.payload_codec import create_key_file
    from llmgw.security.pki import create_ca

    try:
        out = create_ca(_pki_dir(directory))
        payload, _ = create_key_file(out.cert.parent / "payload.key")
    except (FileExistsError, OSError) as exc:
        fail(f"error: {exc}", 2)
    typer.echo(f"{out.cert}\n{out.key}  (keep this key on the control plane only)\n"
               f"{out.cert.parent / 'activity-signing.pub'}\n"
               f"{out.cert.parent / 'activity-signing.key'}  (the control workers' only: it signs node activities)\n"
               f"{payload}  (every llmgw process: it encrypts what Temporal keeps)")


@app.command("payload-key")
def payload_key(
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where the CA is (default <state>/pki)"),
    rotate: bool = typer.Option(False, "--rotate", help="Add a new key as the second line: copy the file to every "
                                "process, then move the new line first to encrypt with it"),
):
    """Make payload.key beside the CA (the key that encrypts every payload llmgw gives Temporal, so its history
    holds no signed URL or setting in the clear), if it is not there yet. Copy it to every llmgw process, or
    point LLMGW_PAYLOAD_KEY at it; during the roll-out set LLMGW_PAYLOAD_ENCRYPT=false until every process has it."""
    from llmgw.security.payload_codec import PayloadKeyError, create_key_file

    path = _pki_dir(directory) / "payload.key"
    existed = path.exists()
    try:
        path, kid = create_key_file(path, rotate=rotate)
    except (PayloadKeyError, OSError) as exc:
        fail(f"error: {exc}", 2)
    if rotate:
        typer.echo(f"{path}: key {kid} added as the second line (it decrypts; move it first to encrypt with it)")
    else:
        typer.echo(f"{path}: key {kid}" + ("  (there already; --rotate adds another)" if existed else ""))


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
    if_due: bool = typer.Option(False, "--if-due", help="Issue only when there is none, or the one there ran out "
                                "or is due for renewal (a setup script run at every start)"),
):
    """Issue a node's client certificate (common name = NODE_ID), valid LLMGW_NODE_CERT_DAYS (7); copy it and
    ca.crt to the node, whose agent renews it before it runs out. After `revoke NODE`, a new one (--force)
    lets the node back."""
    import datetime as dt

    from llmgw.security.pki import issue_node, load_cert, renew_after, serial_text

    existing = _pki_dir(directory) / f"node-{node_id}.crt"
    if if_due and existing.exists():
        try:
            kept = load_cert(existing)
        except (ValueError, OSError) as exc:
            fail(f"error: {existing}: {exc}; pass --force to replace it", 2)
        if renew_after(kept) > dt.datetime.now(dt.timezone.utc):
            typer.echo(f"{existing} kept: valid until {kept.not_valid_after_utc.isoformat(timespec='seconds')}")
            return
        force = True
    try:
        out = issue_node(_pki_dir(directory), node_id, days=Settings().node_cert_days, addresses=address,
                         replace=force)
    except (ValueError, OSError) as exc:
        fail(f"error: {exc}", 2)
    cert = load_cert(out.cert)
    typer.echo(f"{out.cert}\n{out.key}\nserial {serial_text(cert.serial_number)}, valid until "
               f"{cert.not_valid_after_utc.isoformat(timespec='seconds')}")


@app.command("revoke")
def revoke(
    node_id: str = typer.Argument(..., metavar="NODE"),
    serial: Optional[str] = typer.Option(None, "--serial", help="Revoke only this certificate (hex, as `llmgw ctl "
                                         "cert node` and the node API's log print it)"),
    reason: str = typer.Option("", "--reason", help="Kept with the revocation and shown to the node"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Revoke without asking"),
):
    """Revoke NODE's certificates: every one issued up to now (or only --serial). Every node API refuses them
    within LLMGW_REVOCATION_REFRESH_S (5 s), renewals included; `llmgw ctl nodes remove NODE` then forgets
    it for good. A certificate issued later (`llmgw ctl cert node NODE --force`) lets it back."""
    from llmgw.ctl.client import Admin, confirm, seg

    what = f"certificate {serial} of node {node_id}" if serial else f"every certificate of node {node_id} issued until now"
    if not yes and not confirm(f"revoke {what}?"):
        fail("not revoked")
    out = Admin().post(f"/admin/v1/nodes/{seg(node_id)}/revoke", {"serial": serial, "reason": reason})
    typer.echo(f"revoked {what} (at {out['revoked_at']}); node APIs refuse it within LLMGW_REVOCATION_REFRESH_S")


@app.command("revoked")
def revoked():
    """The deny-list: every revocation, oldest first."""
    from llmgw.ctl.client import Admin
    from llmgw.ctl.output import console, table

    rows = Admin().get("/admin/v1/revocations")
    if not rows:
        typer.echo("no node certificate is revoked")
        return
    console().print(table(["NODE", "WHAT", "REVOKED", "REASON"], [
        [r["node_id"], f"serial {r['serial']}" if r["serial"] else f"issued before {r['issued_before']}",
         r["revoked_at"], r["reason"] or "-"] for r in rows]))
