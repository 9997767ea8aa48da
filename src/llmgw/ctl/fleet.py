"""`llmgw ctl models | replicas | nodes | explain | logs | retry`: what runs, what fails and why."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Optional

import typer
from rich.console import Group
from rich.text import Text

from llmgw.ctl.client import Admin, confirm, fail, seg
from llmgw.ctl.output import Output, age, console, dump, interval_option, output_option, seconds, show, table, watch_option
from llmgw.schemas.status import ReplicaStatus


def register(app: typer.Typer) -> None:
    app.command("models")(models)
    app.command("replicas")(replicas)
    nodes_app = typer.Typer(invoke_without_command=True, help="Nodes: list them (no command), or remove one.")
    nodes_app.callback()(nodes)
    nodes_app.command("remove")(nodes_remove)
    app.add_typer(nodes_app, name="nodes")
    app.command("explain")(explain)
    app.command("logs")(logs)
    app.command("retry")(retry)
    app.command("page")(page)


def page():
    """Print the fleet page's address (read-only: models, nodes and their replicas, recent failures, tokens per
    tenant and day, refreshed every 5 s), with the admin token in its fragment: a browser keeps a fragment to
    itself, and the page moves the token to the tab's session storage and out of the address bar."""
    from urllib.parse import quote

    from llmgw.schemas.api import FLEET_PAGE

    admin = Admin()
    if not admin.token.value:
        fail("no admin token to give the page: set LLMGW_ADMIN_TOKEN, or LLMGW_STATE_DIR to the server's state "
             "directory (its admin.token file)")
    typer.echo(f"{admin.url.rstrip('/')}{FLEET_PAGE}#token={quote(admin.token.value, safe='')}")


# ---- models ------------------------------------------------------------------------------------

def next_start(v: dict) -> str:
    """When a failing model (or its latest failed replica, `v`) starts again."""
    left = v.get("retry_in_s")
    if v.get("on_request"):  # on demand, and nothing has asked for it since it failed
        return f"next start when a request asks, not before {seconds(left)}" if left else \
            "next start when a request asks for it"
    return f"next start in {seconds(left)}" if left else "next start due now"


def _model_message(m: dict) -> str:
    if m["status"] == "failing":
        return f"{m['reason']}; failed {m['restarts']} time(s) in a row, {next_start(m)}"
    return m.get("reason") or ""


def _models_table(models: list[dict], now: datetime, wide: bool):
    cols = ["MODEL", "STATUS", "READY", "RESTARTS", "ENGINE", "MODE", "AGE", "MESSAGE"]
    if wide:
        cols[6:6] = ["PRIO", "REPLICAS", "ALIASES", "ADAPTERS"]
    rows = []
    for m in models:
        ready = f"{m['ready']}/{m['min']}" if m["min"] else str(m["ready"])
        engine = ",".join(m["engines"]) or ("?" if m["status"] == "unreadable" else "static")
        # RESTARTS: replicas that ended failed or lost, ever (a server from before `replaced`: in a row).
        row = [m["name"], m["status"], ready, m.get("replaced", m["restarts"]), engine, m["mode"], age(m.get("created_at"), now),
               _model_message(m)]
        if wide:
            reps = ", ".join(f"{n} {s}" for s, n in m["replicas"].items()) or "none"
            # ADAPTERS: each LoRA adapter and how many Ready replicas hold it loaded (`sql 1, law 0`)
            adapters = ", ".join(f"{n} {len(h)}" for n, h in (m.get("adapters") or {}).items()) or "-"
            row[6:6] = [m.get("priority", 0), reps, ",".join(m.get("aliases") or []) or "-", adapters]
        rows.append(row)
    return table(cols, rows)


def models(output: Output = output_option(), watch: bool = watch_option(), interval: float = interval_option()):
    """Catalog models and their status (ready, loading, failing, ...).

    RESTARTS counts the model's replicas that ended failed or lost (an engine that died, a node that went
    away), ever, as Kubernetes counts a pod's. A model whose starts keep failing is `failing`, like
    CrashLoopBackOff: MESSAGE gives the last one's cause, how many failed in a row and the backoff left
    (`ctl retry` clears that count and the backoff, not RESTARTS).
    """
    admin = Admin()
    show(lambda: (admin.get("/admin/v1/models"), admin.now), _models_table, output, watch, interval,
         empty="no models in the catalog; `llmgw ctl apply -f catalog.yaml` adds them")


# ---- replicas ----------------------------------------------------------------------------------

def _shards(r: dict) -> str:
    return ", ".join(f"{s['node_id']}[rank {s['rank']}" + (f", GPUs {','.join(map(str, s['gpus']))}]" if s["gpus"] else "]")
                     for s in r.get("shards", [])) or (r["node_id"] or "-")


def progress_line(p: dict) -> str:
    """`downloading SOURCE: 45.2 of 98.4 MB (46%)`, or `... 45.2 MB so far` when the size is unknown."""
    got = p["bytes"] / 1e6
    if p.get("total"):
        return f"downloading {p['source']}: {got:.1f} of {p['total'] / 1e6:.1f} MB ({100 * p['bytes'] // p['total']}%)"
    return f"downloading {p['source']}: {got:.1f} MB so far"


def _replica_message(r: dict) -> str:
    if r["status"] == ReplicaStatus.FAILED:
        msg = r.get("cause") or "failed"
        if r.get("retry_in_s") is not None:  # the latest failed replica of a failing model: as `ctl models` says it
            msg += f"; failed {r.get('restarts', 0)} time(s) in a row, {next_start(r)}"
        return msg
    if r["status"] in ReplicaStatus.ended():
        why = r.get("cause") or r.get("ended_reason") or r.get("failure") or ""
        return why.splitlines()[0][:300] if why else ""
    lines = [f"{s['node_id']}: {progress_line(s['progress'])}" for s in r.get("shards", []) if s.get("progress")]
    if r.get("silent_nodes"):  # "node status" of its nodes that are not Ready (both witnesses silent)
        lines.insert(0, f"node {', '.join(r['silent_nodes'])}: not routed to (heartbeats and pollers silent)")
    return "; ".join(lines)


def _replicas_table(reps: list[dict], now: datetime, wide: bool):
    # No RESTARTS column: a replica is replaced, never restarted; RESTARTS is the model's count (`ctl models`,
    # the fleet page), and a failing model's latest failed replica says how many failed in a row in MESSAGE.
    cols = ["REPLICA", "MODEL", "PROFILE", "STATUS", "SHARDS", "AGE", "MESSAGE"]
    if wide:
        cols[5:5] = ["ENDPOINT"]
        cols.append("TEMPORAL")
    rows = []
    for r in reps:
        # profile@hash: what its node reports it runs; a rolling replacement retires the ones the catalog changed.
        # Before its node has reported (fetching, or failed before launch): the profile's name alone.
        profile = f"{r['profile']}@{r['profile_hash'][:8]}" if r.get("profile_hash") else r["profile"]
        row = [r["id"][:8], r["model"], profile, r["status"], _shards(r), age(r["created_at"], now),
               _replica_message(r)]
        if wide:
            row[5:5] = [r["endpoint"] or "-"]
            row.append(r.get("temporal_url") or "-")
        rows.append(row)
    return table(cols, rows)


def replicas(
    all: bool = typer.Option(False, "--all", "-a", help="Include every stopped, failed and lost replica"),
    output: Output = output_option(), watch: bool = watch_option(), interval: float = interval_option(),
):
    """Replicas: status, shards (node, rank, GPUs), age, and why one failed.

    A failing model's latest failed replica is listed too, with how many failed in a row, its decoded cause ("killed by
    SIGILL (illegal instruction): ...") and the backoff left. PROFILE is `name@hash` of the profile its node
    reports it runs (the name alone until its node has launched it). `-o wide` adds the endpoint and the Temporal UI link listing the replica's workflows.
    """
    admin = Admin()
    show(lambda: (admin.get("/admin/v1/replicas", all=str(all).lower()), admin.now), _replicas_table, output,
         watch, interval, empty="no replicas" + ("" if all else "; --all includes ended ones"))


# ---- nodes -------------------------------------------------------------------------------------

def _gpus(inv: dict) -> str:
    gpus = inv["gpus"]
    if not gpus:
        return "0"
    text = f"{len(gpus)}x{gpus[0]['memory_mb'] // 1024}GiB"
    return text + (" nvlink" if any(g["nvlink_peers"] for g in gpus) else "")


def _ago(s: float | None, now: datetime) -> str:
    return "never" if s is None else age(now - timedelta(seconds=s), now) + " ago"


def _nodes_table(nodes: list[dict], now: datetime, wide: bool):
    """Both liveness witnesses: LAST SEEN (the node's last heartbeat to the node API) and POLLERS (its
    worker polling `node/<id>`, as last read); MESSAGE says how the control plane judges them, and why a silent
    node is not declared lost. What the control plane itself cannot see now comes first, as notes."""
    cols = ["NODE", "STATUS", "VERSION", "GPUS", "CPUS", "MEMORY", "DISK FREE", "ENGINES", "LAST SEEN", "POLLERS",
            "AGE", "MESSAGE"]
    if wide:
        cols[7:7] = ["FABRICS"]
        cols.append("NOTES")
    rows = []
    for n in nodes:
        inv = n["inventory"]
        engines = ",".join(inv["engines"]) + (" (simulated)" if inv.get("simulated") else "")
        seen = _ago(n["heartbeat_age_s"], now) if "heartbeat_age_s" in n else age(n.get("last_heartbeat"), now) + " ago"
        row = [n["id"], n["status"], n.get("version") or "-", _gpus(inv), inv["cpus"], f"{inv['memory_mb'] // 1024}GiB",
               f"{inv['disk_free_mb'] // 1024}GiB", engines, seen, n.get("pollers") or _ago(n.get("poll_age_s"), now),
               age(n.get("registered_at"), now), n.get("liveness") or ""]
        if wide:
            row[7:7] = [",".join(f"{f['name']}({len(f['adapters'])} HCA, {f['rate_gbps']:g}Gb/s)"
                                 for f in inv.get("fabrics", [])) or "-"]
            row.append("; ".join(x for x in inv.get("notes", []) if not x.startswith("simulated inventory")) or "-")
        rows.append(row)
    notes = (nodes[0].get("notes") or []) if nodes else []
    if notes:
        return Group(*(Text(f"note: {x}") for x in notes), table(cols, rows))
    return table(cols, rows)


def nodes(ctx: typer.Context, output: Output = output_option(), watch: bool = watch_option(),
          interval: float = interval_option()):
    """Nodes: status, both liveness witnesses (heartbeats, pollers) and inventory (GPUs, CPUs, memory, disk,
    engines); `nodes remove NODE` forgets one.

    LAST SEEN is its last heartbeat; POLLERS is its worker's pollers on its task queue as the control worker
    last read them (in rotation): `polling, read 3s ago`, or `silent 4m, read 3s ago` once its last poll
    began more than LLMGW_POLLER_GRACE_S (60 s, a long poll's length) before that read. `-o wide` adds
    InfiniBand fabrics and discovery notes.
    """
    if ctx.invoked_subcommand is not None:
        return
    admin = Admin()
    show(lambda: (admin.get("/admin/v1/nodes"), admin.now), _nodes_table, output, watch, interval,
         empty="no nodes have registered; start `llmgw agent` on each machine")


def nodes_remove(
    node_id: str = typer.Argument(..., metavar="NODE"),
    force: bool = typer.Option(False, "--force", help="Remove it even with live replicas (they are lost and rebuilt elsewhere)"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking"),
):
    """Forget NODE now (a decommissioned machine), as happens by itself once it has been Lost for
    LLMGW_NODE_FORGET_AFTER_S. Refused while replicas still run on it, unless --force. Its agent registers
    it again unless it is stopped or its certificate revoked first (`llmgw ctl cert revoke NODE`)."""
    admin = Admin()
    plan = admin.post(f"/admin/v1/nodes/{seg(node_id)}/remove", {"force": force, "dry_run": True})
    typer.echo(f"  {plan['node_id']}  {plan['status']}")
    for r in plan["live_replicas"]:
        if r["status"] in ReplicaStatus.ended():  # ended, but a shard of it may still run there: not settled yet
            typer.echo(f"    replica {r['id'][:8]} of {r['model']} ({r['status']}; not every shard of it is known "
                       "to have stopped yet)")
        else:
            typer.echo(f"    live replica {r['id'][:8]} of {r['model']} ({r['status']})")
    if plan["note"]:
        typer.echo(f"  note: {plan['note']}")
    if plan["live_replicas"] and not force:
        fail(f"not removed: node {node_id} still holds shards of {len(plan['live_replicas'])} replica(s); stop them "
             "first (remove their models, or wait until the node is lost and they move), or pass --force to "
             "mark them lost and rebuild them elsewhere now")
    if not yes and not confirm("remove?"):
        fail("not removed")
    out = admin.post(f"/admin/v1/nodes/{seg(node_id)}/remove", {"force": force})
    lost = f"; {len(out['live_replicas'])} replica(s) on it are lost and rebuilt elsewhere" if out["live_replicas"] else ""
    typer.echo(f"removed {node_id}{lost}")


# ---- explain -----------------------------------------------------------------------------------

def explain(model: str = typer.Argument(..., metavar="MODEL", help="A model or alias"), output: Output = output_option()):
    """Why the last reconcile pass did (or did not) place MODEL.

    Every candidate turned down and why, and why each of its replicas is where it is (or why it ended).
    """
    out = Admin().get(f"/admin/v1/explain/{seg(model)}")
    if output in (Output.json, Output.yaml):
        console().print(dump(out, output).rstrip("\n"), markup=False)
        return
    failing = out.get("reconciler_failure")
    if failing:
        typer.echo(f"the reconciler's planner is failing (attempt {failing['attempt']}, at {failing['failed_at']}; "
                   f"last good pass at {failing['last_pass_at'] or 'never'}), retrying with a newer snapshot:")
        typer.echo(f"  {failing['failure']}")
    at = f" (pass at {out['decided_at']})" if out.get("decided_at") else ""
    if not out["decisions"]:
        typer.echo(f"{model}: no reconcile pass has decided anything about it yet")
    else:
        typer.echo(f"latest pass{at}:")
    for line in out["decisions"]:
        typer.echo(f"  {line}")
    reps = out.get("replicas", [])
    if reps:
        typer.echo("replicas:")
    for r in reps:
        typer.echo(f"  {r['id'][:8]} {r['status']:9s} {_shards(r)}")
        for i, line in enumerate((r.get("reason") or "").splitlines()):
            typer.echo(f"      placed: {line}" if i == 0 else f"      {line}")
        if r["status"] in ReplicaStatus.ended() and (r.get("cause") or r.get("ended_reason") or r.get("failure")):
            typer.echo(f"      ended: {(r.get('cause') or r.get('ended_reason') or r.get('failure')).splitlines()[0][:300]}")
    if out.get("adapters"):  # (a server before issue 40 sends none)
        typer.echo("adapters (loaded by demand; each replica unloads its least recently used past max_loras):")
    for a in out.get("adapters", []):
        where = ", ".join(h["id"][:8] for h in a["replicas"]) or "no replica (loaded by its next request)"
        only = f" [tenants {', '.join(a['tenants'])}]" if a.get("tenants") is not None else ""
        typer.echo(f"  {a['name']}{'@' + a['version'] if a.get('version') else ''}{only}: loaded in {where}")
        for b in a.get("unverified") or []:  # never loaded there: its file failed on the node
            typer.echo(f"    NOT LOADABLE in {b['id'][:8]} (node {b['node']}): {b['error'].splitlines()[0][:300]}")


# ---- logs --------------------------------------------------------------------------------------

def logs(
    replica: str = typer.Argument(..., metavar="REPLICA", help="A replica id, or its first characters (as `ctl replicas` prints)"),
    rank: int = typer.Option(0, "--rank", "-r", min=0, metavar="N", help="Which shard of a multi-node replica"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output while the engine runs"),
    tail: Optional[int] = typer.Option(None, "--tail", min=0, metavar="LINES", help="Only the last N lines"),
    limit_bytes: int = typer.Option(65536, "--limit-bytes", min=1, max=1 << 20, metavar="BYTES", help="Read at most this much of the log's end"),
):
    """The engine log of a replica's shard, read on its node.

    The node worker reads it (no path on any disk, no login on the node needed). When the node does not
    answer, the output it last reported is shown instead, and says so.
    """
    admin = Admin(timeout_s=60)
    got = admin.get(f"/admin/v1/replicas/{seg(replica)}/logs", rank=rank, offset=-1, limit=limit_bytes)
    if got.get("note"):
        typer.echo(got["note"], err=True)
    elif not got["found"]:
        typer.echo(f"node {got['node_id']} has no log for shard {got['shard_id']} (it never launched there)", err=True)
    data = got["data"]
    if tail is not None:
        data = "".join(data.splitlines(keepends=True)[-tail:]) if tail else ""
    _write(data)
    if not follow:
        return
    offset = got["offset"]
    try:
        while True:
            if not got["running"] and got["from_node"]:
                typer.echo(f"(the engine of shard {got['shard_id']} is not running)", err=True)
                return
            time.sleep(1.0)
            got = admin.get(f"/admin/v1/replicas/{seg(got['replica_id'])}/logs", rank=rank, offset=offset, limit=1 << 20)
            if got["from_node"]:
                _write(got["data"])
                offset = got["offset"]
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _write(text: str) -> None:
    if text:
        typer.echo(text, nl=not text.endswith("\n"))


# ---- retry -------------------------------------------------------------------------------------

def retry(model: str = typer.Argument(..., metavar="MODEL", help="A model or alias")):
    """Start a failing MODEL now: clear its failed starts and backoff (after fixing the cause)."""
    out = Admin().post(f"/admin/v1/models/{seg(model)}/retry")
    if not out["failures"] and not out["backoff_left_s"]:
        typer.echo(f"{out['model']}: no failed starts to clear; the reconciler was asked to look at it again")
        return
    when = ("the reconciler starts it now if it was asked for within its idle_timeout, else at the next request "
            "(on demand)") if out.get("on_demand") else "the reconciler starts it now"
    typer.echo(f"{out['model']}: cleared {out['failures']} failed start(s) and {seconds(out['backoff_left_s'])} of "
               f"backoff; {when} (`llmgw ctl models -w` follows it)")
