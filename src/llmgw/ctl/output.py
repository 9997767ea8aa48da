"""How `llmgw ctl` prints, with kubectl's habits: tables with a header and an AGE column (`-o table`, the
default, and `-o wide` with more columns), or the admin API's objects as `-o json` / `-o yaml`; `--watch`
prints the listing again whenever it changes until Ctrl-C."""

from __future__ import annotations

import json
import signal
import sys
import time
from datetime import datetime
from enum import StrEnum
from typing import Any, Callable, Sequence

import typer
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text


class Output(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


def output_option() -> Any:
    return typer.Option(Output.table, "--output", "-o", help="table (default), wide (more columns), json or yaml",
                        case_sensitive=False)


def watch_option() -> Any:
    return typer.Option(False, "--watch", "-w", help="Print again whenever it changes (Ctrl-C stops)")


def interval_option() -> Any:
    return typer.Option(2.0, "--interval", metavar="SECONDS", min=0.2, max=3600,
                        help="Seconds between refreshes with --watch (0.2 to 3600)")


def console() -> Console:
    """Wrapped to the terminal when there is one; one line per row when piped (for grep and scripts)."""
    tty = sys.stdout.isatty()
    return Console(highlight=False, soft_wrap=not tty, width=None if tty else 100_000)


def age(ts: datetime | str | None, now: datetime) -> str:
    """kubectl's AGE: `45s`, `12m`, `3h20m`, `5d`; `-` when unknown."""
    if ts is None:
        return "-"
    if isinstance(ts, str):
        ts = datetime.fromisoformat(ts)
    s = max(0, int((now - ts).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 10 * 3600:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m}m" if m else f"{h}h"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def seconds(s: float | int | None) -> str:
    """`42s`, `5m30s`: a duration left."""
    if s is None:
        return "-"
    s = int(s)
    return f"{s}s" if s < 120 else f"{s // 60}m{s % 60:02d}s"


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A kubectl-like table: upper-case headers, no borders, cells as plain text (never rich markup)."""
    t = Table(box=None, show_header=True, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
    for c in columns:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*(Text("" if v is None else str(v)) for v in row))
    return t


def dump(data: Any, fmt: Output) -> str:
    if fmt == Output.json:
        return json.dumps(data, indent=2, default=str)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def show(fetch: Callable[[], tuple[Any, datetime]], render: Callable[[Any, datetime, bool], Table | str],
         fmt: Output, watch: bool = False, interval_s: float = 2.0, empty: str = "") -> None:
    """Print what `fetch()` returns (data, server time) as `fmt`; tables through `render(data, now, wide)`.
    `empty` goes to stderr when a table has no rows (so a listing never prints nothing at all).
    With `watch`, fetch again every `interval_s` and print whenever the output changed."""
    out = console()
    if watch:
        # Ctrl-C or `kill -INT` stops it even when started in the background of a script, whose shell hands
        # SIGINT down ignored (Python keeps an ignored SIGINT ignored: the watch could not be stopped).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if watch and fmt in (Output.table, Output.wide) and out.is_terminal:
        return _live(fetch, render, fmt == Output.wide, interval_s, out)
    last = None
    try:
        while True:
            data, now = fetch()
            if fmt in (Output.json, Output.yaml):
                text: Any = dump(data, fmt)
                key = text
            else:
                text = render(data, now, fmt == Output.wide)
                with out.capture() as cap:
                    out.print(text)
                key = cap.get()
            if key != last:
                if last is not None and fmt in (Output.json, Output.yaml):
                    out.print("---" if fmt == Output.yaml else "", markup=False)
                if isinstance(text, str):
                    out.print(text.rstrip("\n"), markup=False)
                else:
                    out.print(text)
                if empty and not data and last is None:
                    typer.echo(empty, err=True)
                last = key
            if not watch:
                return
            sys.stdout.flush()
            time.sleep(max(0.2, interval_s))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _live(fetch, render, wide: bool, interval_s: float, out: Console) -> None:
    """`--watch` on a terminal: the table redrawn in place (rich's Live display)."""
    from rich.live import Live

    try:
        data, now = fetch()
        with Live(render(data, now, wide), console=out, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                data, now = fetch()
                live.update(render(data, now, wide), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
