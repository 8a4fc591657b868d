"""``mserve top``: a live view of a running server in the terminal, redrawn every second
(rich's ``Live``). Keys: a column letter sorts the models by it, the arrows (or j/k) pick one,
Enter opens it (its versions and workers), Escape or Backspace goes back, q quits. What it
shows is read by server/top_data.py."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from server.top_data import ModelRow, Reader, Snapshot

# sort keys: key -> (column title, what it sorts by, largest first)
SORTS = {
    "n": ("MODEL", lambda m: m.name, False),
    "r": ("REQ/S", lambda m: m.requests_per_s, True),
    "e": ("ERRORS", lambda m: m.errors, True),
    "l": ("P99", lambda m: m.p99_s or 0.0, True),
    "d": ("QUEUE", lambda m: m.queue, True),
    "m": ("MEM", lambda m: m.memory_bytes, True),
}
KEYS_HELP = (
    "sort: n name  r req/s  e errors  l p99  d queue  m memory   "
    "↑/↓ j/k pick  Enter open  Esc back  q quit"
)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def _uptime(seconds: float) -> str:
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return (f"{days}d " if days else "") + f"{hours:02d}:{minutes:02d}:{sec:02d}"


class View:
    """What the screen shows now: the sort, the picked row, the opened model."""

    def __init__(self) -> None:
        self.sort = "n"
        self.picked = 0
        self.opened: str | None = None
        self.models: list[ModelRow] = []

    def key(self, key: str) -> bool:
        """Act on one key; False: quit."""
        if key in ("q", "\x03"):
            return False
        if self.opened is not None:
            if key in ("\x1b", "\x7f", "\x08"):
                self.opened = None
        elif key in SORTS:
            self.sort = key
        elif key in ("j", "down"):
            self.picked = min(self.picked + 1, max(len(self.models) - 1, 0))
        elif key in ("k", "up"):
            self.picked = max(self.picked - 1, 0)
        elif key in ("\r", "\n") and self.models:
            self.opened = self.models[min(self.picked, len(self.models) - 1)].name
        return True

    def render(self, snap: Snapshot) -> RenderableType:
        title, by, reverse = SORTS[self.sort]
        self.models = sorted(snap.models, key=by, reverse=reverse)
        parts: list[RenderableType] = [self._header(snap)]
        opened = next((m for m in self.models if m.name == self.opened), None)
        parts.append(self._model(opened) if opened else self._table(title))
        parts.append(Text(KEYS_HELP if opened is None else "Esc back  q quit", style="dim"))
        return Group(*parts)

    def _header(self, snap: Snapshot) -> RenderableType:
        status = snap.status
        urls = status.get("urls") or {}
        lines = [
            f"mserve {status.get('version')} pid {status.get('pid')}  up "
            f"{_uptime(snap.uptime_s)}  models {len(snap.models)}",
            "  ".join(f"{api} {url}" for api, url in urls.items() if url),
            f"workers' memory {_mib(snap.memory_bytes)}"
            + (f" of {_mib(snap.budget_bytes)} budget" if snap.budget_bytes else " (no budget)")
            + (
                f"  warm tier {_mib(snap.warm_bytes)} of {_mib(snap.warm_budget_bytes)}"
                if snap.warm_budget_bytes
                else ""
            ),
        ]
        text = Text("\n".join(lines))
        if snap.error:
            text.append(f"\n{snap.error}", style="bold red")
        return text

    def _table(self, sorted_by: str) -> Table:
        columns = ("MODEL", "VERSIONS", "STATE", "WORKERS", "QUEUE", "REQ/S", "P50", "P99",
                   "ERRORS", "EVICT", "CPU", "MEM", "TIER", "WAKE")  # fmt: skip
        table = Table(expand=True, box=None, header_style="bold reverse")
        for column in columns:
            table.add_column(column + (" ▼" if column == sorted_by else ""), no_wrap=True)
        for i, m in enumerate(self.models):
            cpu = [w.cpu_percent for w in m.workers if w.cpu_percent is not None]
            ready = sum(1 for w in m.workers if w.state in ("READY", "BUSY"))
            table.add_row(
                m.name, ",".join(v.version for v in m.versions), m.state,
                f"{ready}/{len(m.workers)}", str(m.queue), f"{m.requests_per_s:.1f}",
                _ms(m.p50_s), _ms(m.p99_s), str(m.errors), str(m.evictions),
                f"{sum(cpu):.0f}%" if cpu else "-", _mib(m.memory_bytes), m.tier,
                _seconds(m.wake_s),
                style="reverse" if i == self.picked else None,
            )  # fmt: skip
        return table

    def _model(self, m: ModelRow) -> RenderableType:
        parts: list[RenderableType] = [Text(
            f"model {m.name}: {m.requests_per_s:.1f} req/s  p50 {_ms(m.p50_s)}  p99 "
            f"{_ms(m.p99_s)}  errors {m.errors}  evictions {m.evictions}", style="bold",
        )]  # fmt: skip
        if m.swap:
            parts.append(Text(m.swap, style="bold"))
        if m.traffic:
            parts.append(Text(m.traffic, style="bold"))
        if m.tenants:
            parts.append(Text(m.tenants))
        for v in m.versions:
            parts.append(Text(
                f"version {v.version}: {v.status} ({v.load_state})  workers min {v.min_workers}"
                f" max {v.max_workers}  queue {v.queue}"
                f"\n  tier {v.tier or '-'}  worker {_mib(v.worker_bytes)}  warm"
                f" {_mib(v.warm_bytes)}  cold load {_seconds(v.load_s)}  wake {_seconds(v.wake_s)}"
                + (f"\n  failed: {v.failure}" if v.failure else "")
            ))  # fmt: skip
            table = Table(box=None, header_style="bold reverse")
            for column in ("WORKER", "STATE", "PID", "CPU", "MEM"):
                table.add_column(column, no_wrap=True)
            for w in v.workers:
                cpu = "-" if w.cpu_percent is None else f"{w.cpu_percent:.0f}%"
                table.add_row(w.id, w.state, str(w.pid), cpu, _mib(w.memory_bytes))
            parts.append(table)
        return Group(*parts)


@contextlib.contextmanager
def _raw_keys() -> Iterator[int]:
    """The terminal in cbreak mode (keys arrive one by one, unechoed) while the view runs."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _keys(fd: int, timeout_s: float) -> list[str]:
    """The keys pressed within ``timeout_s`` (none: the refresh is due); arrows as up/down."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        return []
    data = os.read(fd, 64).decode("utf-8", "replace")
    data = data.replace("\x1b[A", "\x00up\x00").replace("\x1b[B", "\x00down\x00")
    keys: list[str] = []
    for chunk in data.split("\x00"):
        keys += [chunk] if chunk in ("up", "down") else list(chunk)
    return keys


def run(status: dict[str, object], interval_s: float, once: bool) -> None:
    reader = Reader(status)
    view = View()
    console = Console()
    try:
        if once or not sys.stdin.isatty():
            console.print(view.render(reader.read()))
            return
        with _raw_keys() as fd, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                live.update(view.render(reader.read()), refresh=True)
                due = time.monotonic() + interval_s
                while (left := due - time.monotonic()) > 0:
                    keys = _keys(fd, left)
                    if not all(view.key(k) for k in keys):
                        return
                    if keys:
                        live.update(view.render(reader.read()), refresh=True)
    finally:
        reader.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run-dir", help="The server's run dir (default: the config's, else ~/.mserve).")
@click.option("--config", "config_file", type=click.Path(path_type=Path),
              help="The server's config YAML (for its run_dir).")  # fmt: skip
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one view and exit (also without a terminal).")
def top_main(run_dir: str | None, config_file: Path | None, interval: float, once: bool) -> None:
    """A live view of the running server: its models, workers, traffic and memory."""
    from server.config import load_config
    from server.errors import MserveError
    from server.rundir import read_status, running_pid

    try:
        run_path = load_config(config_file, {"run_dir": run_dir}).run_path
    except MserveError as exc:
        raise click.ClickException(str(exc)) from None
    status = read_status(run_path) if running_pid(run_path) else None
    if status is None:
        click.echo(f"mserve: mserve is not running (run dir {run_path})", err=True)
        sys.exit(3)
    run(status, interval, once)


def main(args: list[str]) -> None:
    """``mserve top ...`` (server/cli.py hands it the arguments after ``top``)."""
    top_main.main(args=args, prog_name="mserve top")
