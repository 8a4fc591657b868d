"""``mserve replay LOG... --against TARGET``: the command line (docs/replay.md)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from server.compare import CompareOptions
from server.replay.html import render
from server.replay.records import Skipped, read
from server.replay.report import Summary
from server.replay.run import Pace, Selection, replay, select
from server.replay.target import APIS, Target, headers_from


def _when(value: str | None, flag: str) -> float | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 time", param_hint=flag) from None
    if moment.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no time zone (add Z or +00:00)", param_hint=flag)
    return moment.timestamp()


def _count_records(paths: list[Path]) -> int | None:
    """Lines in plain files, for the progress bar's total (None when a file is gzipped: reading
    it twice costs more than a bar is worth)."""
    from server.replay.records import log_files

    total = 0
    for path in log_files(paths):
        if path.name.endswith(".gz"):
            return None
        try:
            with open(path, "rb") as f:
                total += sum(1 for _ in f)
        except OSError:
            return None
    return total


@click.command(
    "replay",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--against", "url", required=True, metavar="URL",
              help="The target: a base URL (http://127.0.0.1:8080), paths made per API, or a full "
                   "endpoint every request goes to.")  # fmt: skip
@click.option("--api", type=click.Choice(APIS), default="auto", show_default=True,
              help="The target's API; auto: the one each request was recorded on.")  # fmt: skip
@click.option("--model", default=None, help="Replay this model's records (default: the first's).")
@click.option("--target-model", default=None, help="The model's name on the target, if another.")
@click.option("--version", "target_version", default=None,
              help="The target's version of the model (mserve, TorchServe, OIP).")  # fmt: skip
@click.option("--concurrency", "-c", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Requests in flight at most.")  # fmt: skip
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Pace as recorded, times this (2: twice as fast); default: as fast as "
                   "--concurrency allows.")  # fmt: skip
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds a request may take.")  # fmt: skip
@click.option("--sample", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True, help="Share of the records to replay, at random.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="The sample's seed.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Replay at most N records.")
@click.option("--since", default=None, metavar="TIME", help="Records from this ISO 8601 time.")
@click.option("--until", default=None, metavar="TIME", help="Records up to this ISO 8601 time.")
@click.option("--abs-tol", type=float, default=0.0, show_default=True,
              help="Numbers this close are equal.")  # fmt: skip
@click.option("--rel-tol", type=float, default=0.0, show_default=True,
              help="Numbers within this relative error are equal.")  # fmt: skip
@click.option("--top-k", type=int, default=0, show_default=True,
              help="Compare classification answers by their top k labels.")  # fmt: skip
@click.option("--max-differing", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Exit 1 when a larger share of answers differs or fails.")  # fmt: skip
@click.option("--json", "json_path", default=None, metavar="PATH",
              help="Write the JSON report there ('-': standard output).")  # fmt: skip
@click.option("--html", "html_path", type=click.Path(path_type=Path), default=None,
              help="Write the HTML report there.")  # fmt: skip
@click.option("--header", "-H", "header_pairs", multiple=True, metavar="'NAME: VALUE'",
              help="A header every request carries (repeatable).")  # fmt: skip
@click.option("--key-file", type=click.Path(exists=True, path_type=Path), default=None,
              help="An mserve or TorchServe key_file.json: its inference key is sent.")  # fmt: skip
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary table.")
def replay_main(
    logs: tuple[Path, ...], url: str, api: str, model: str | None, target_model: str | None,
    target_version: str | None, concurrency: int, speed: float | None, timeout_s: float,
    sample: float, seed: int, limit: int | None, since: str | None, until: str | None,
    abs_tol: float, rel_tol: float, top_k: int, max_differing: float, json_path: str | None,
    html_path: Path | None, header_pairs: tuple[str, ...], key_file: Path | None, quiet: bool,
) -> None:  # fmt: skip
    """Replay what an inference log recorded against TARGET and compare the answers.

    LOG: mserve's inference-log files (rotated ones, .gz too) or folders of them, or folders
    of KServe's CloudEvents in the CloudEvents JSON format. Exit codes: 0 the answers match
    within the threshold, 1 they do not, 2 bad usage, 3 the target answered nothing,
    4 nothing to replay."""
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(
            f"{url!r} is not an http:// or https:// URL", param_hint="--against"
        )
    try:
        options = CompareOptions.from_dict({"abs_tol": abs_tol, "rel_tol": rel_tol, "top_k": top_k})
        headers = headers_from(header_pairs, key_file)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    selection = Selection(model, _when(since, "--since"), _when(until, "--until"), sample, seed,
                          limit)  # fmt: skip
    target = Target(url, api, target_model, target_version)
    paths = list(logs)
    to_stdout = json_path == "-"
    console = Console(stderr=to_stdout or quiet, quiet=quiet)
    summary = Summary(url, [str(p) for p in paths], options.to_dict())
    skipped = Skipped()
    records = select(read(paths, skipped), selection, skipped)
    pace = Pace(concurrency, speed, timeout_s)
    total = _count_records(paths) if not quiet else None
    with Progress(
        TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[diff]} differ"), console=console, transient=True,
        disable=quiet,
    ) as progress:  # fmt: skip
        task = progress.add_task("replay", total=total, diff=0)

        done = [0, 0.0]  # records since the bar was drawn, when it was

        def advance() -> None:
            # the bar redraws ~10 times a second: updating it per record cost ~40 us each
            done[0] += 1
            now = time.monotonic()
            if now - done[1] >= 0.1:
                progress.update(task, advance=done[0], diff=summary.differing)
                done[0], done[1] = 0, now

        asyncio.run(replay(records, target, headers, pace, options, summary, advance))
    report = summary.to_dict(skipped, max_differing)
    if not quiet:
        _print_summary(console, report)
    if json_path is not None:
        text = json.dumps(report, indent=2)
        if to_stdout:
            sys.stdout.write(text + "\n")
        else:
            Path(json_path).write_text(text + "\n")
    if html_path is not None:
        html_path.write_text(render(report))
    code = report["exit_code"]
    if code:
        click.echo(f"mserve replay: {report['verdict']}", err=True)
    sys.exit(code)


def _print_summary(console: Console, report: dict[str, Any]) -> None:
    counts = report["counts"]
    table = Table(title=f"replay of {report['model']} against {report['target']}")
    for column in ("sent", "answered", "equal", "differing", "failed", "skipped"):
        table.add_column(column, justify="right")
    failed = sum(counts["failed"].values())
    skipped = sum(counts["skipped"].values())
    table.add_row(*(str(x) for x in (counts["sent"], counts["answered"], counts["equal"],
                                    counts["differing"], failed, skipped)))  # fmt: skip
    console.print(table)
    latency = Table(title="latency (ms)")
    for column in ("", "p50", "p90", "p99"):
        latency.add_column(column, justify="right")
    for side in ("recorded", "replayed"):
        q = report["latency_ms"][side]
        latency.add_row(
            side, *("-" if q[p] is None else f"{q[p]:.2f}" for p in ("p50", "p90", "p99"))
        )
    console.print(latency)
    if report["by_field"]:
        fields = Table(title="differences by field")
        fields.add_column("field")
        fields.add_column("answers", justify="right")
        for path, count in list(report["by_field"].items())[:10]:
            fields.add_row(path, str(count))
        console.print(fields)
    for kind, count in counts["failed"].items():
        console.print(f"failed ({kind}): {count}")
    for reason, count in counts["skipped"].items():
        console.print(f"skipped ({reason}): {count}")
    console.print(report["verdict"])


def main(args: list[str]) -> None:
    """``mserve replay ...`` (server/cli.py hands it the arguments after ``replay``)."""
    replay_main.main(args=args, prog_name="mserve replay")
