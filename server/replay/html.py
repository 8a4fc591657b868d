"""The replay's HTML report: one self-contained page (inline SVG and CSS, no script, nothing
fetched), for a person to open in a browser: the verdict, latency distributions recorded and
replayed side by side, differences by field and kind, and the worst pairs with their bodies."""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

_RECORDED = "#4e79a7"
_REPLAYED = "#f28e2b"
_BINS = 30


def render(report: dict[str, Any]) -> str:
    """The page for a report made by :meth:`server.replay.report.Summary.to_dict`."""
    counts = report["counts"]
    verdict_class = "pass" if report["passed"] else "fail"
    latency = report["latency_ms"]
    rows = "".join(
        f"<tr><th>{escape(name)}</th>"
        + "".join(f"<td>{_ms(latency[name].get(q))}</td>" for q in ("p50", "p90", "p99"))
        + f"<td>{latency[name].get('count', 0)}</td></tr>"
        for name in ("recorded", "replayed")
    )
    skipped = ", ".join(f"{escape(k)}: {v}" for k, v in counts["skipped"].items()) or "none"
    failed = ", ".join(f"{escape(k)}: {v}" for k, v in counts["failed"].items()) or "none"
    top_k = report.get("top_k")
    top_k_line = (
        f"<p>Top-{top_k['k']} agreement: {top_k['agreed']} of {top_k['rankings']} rankings "
        f"({top_k['top1_agreed']} with the same first label)</p>"
        if top_k
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>mserve replay: {escape(str(report.get("model")))} against {escape(report["target"])}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; }}
.verdict {{ padding: .6em 1em; border-radius: 6px; font-weight: 600; }}
.pass {{ background: #e3f4e1; color: #1d5e1a; }} .fail {{ background: #fbe3e1; color: #8a1c12; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
td, th {{ border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }}
.cards {{ display: flex; gap: 1em; flex-wrap: wrap; }}
.card {{ border: 1px solid #ddd; border-radius: 6px; padding: .5em 1em; min-width: 8em; }}
.card b {{ display: block; font-size: 1.5em; }}
pre {{ white-space: pre-wrap; word-break: break-all; max-height: 14em; overflow: auto;
       background: #f6f6f6; padding: .4em; margin: 0; font-size: 12px; }}
.legend span {{ display: inline-block; width: 1em; height: 1em; vertical-align: middle; }}
</style></head><body>
<h1>mserve replay of {escape(str(report.get("model")))} against {escape(report["target"])}</h1>
<p class="verdict {verdict_class}">{escape(report["verdict"])}</p>
<div class="cards">
<div class="card">sent<b>{counts["sent"]}</b></div>
<div class="card">answered<b>{counts["answered"]}</b></div>
<div class="card">equal<b>{counts["equal"]}</b></div>
<div class="card">differing<b>{counts["differing"]}</b></div>
<div class="card">throughput<b>{report.get("throughput_rps") or "-"}</b>requests/s</div>
</div>
<p>Failed: {failed}. Skipped: {skipped}.</p>
<p>Inputs: {escape(", ".join(report["inputs"]))}.
Options: {escape(json.dumps(report["options"]))}</p>
{top_k_line}
<h2>Latency, recorded and replayed (ms)</h2>
<table><tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>requests</th></tr>{rows}</table>
<p class="legend"><span style="background:{_RECORDED}"></span> recorded (the server's own
arrival-to-answer time) &nbsp; <span style="background:{_REPLAYED}"></span> replayed (the
client's, network included)</p>
{_latency_svg(report["latency_samples_ms"])}
<h2>Differences by field</h2>
{_bars_svg(report["by_field"], "#e15759") if report["by_field"] else "<p>No field differs.</p>"}
<h2>Differences by kind</h2>
{_bars_svg(report["by_kind"], "#76b7b2") if report["by_kind"] else "<p>None.</p>"}
<h2>The worst pairs</h2>
{_worst(report["worst"])}
{_places(report)}
</body></html>
"""


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _latency_svg(samples: dict[str, list[float]]) -> str:
    recorded, replayed = samples["recorded"], samples["replayed"]
    both = sorted(recorded + replayed)
    if not both:
        return "<p>No latencies.</p>"
    # the 99th percentile bounds the axis, so that one slow request does not squash the rest
    top = both[min(len(both) - 1, math.ceil(0.99 * len(both)))] or 1.0
    width, height, pad = 900, 240, 40
    step = top / _BINS

    def histogram(values: list[float]) -> list[float]:
        bins = [0] * _BINS
        for v in values:
            bins[min(_BINS - 1, int(v / step))] += 1
        total = len(values) or 1
        return [b / total for b in bins]

    h_rec, h_rep = histogram(recorded), histogram(replayed)
    peak = max(h_rec + h_rep) or 1.0
    slot = (width - 2 * pad) / _BINS
    bar = slot / 2 - 1
    parts = []
    for i in range(_BINS):
        x = pad + i * slot
        for j, (share, color) in enumerate(((h_rec[i], _RECORDED), (h_rep[i], _REPLAYED))):
            h = (height - 2 * pad) * share / peak
            parts.append(
                f'<rect x="{x + j * (bar + 1):.1f}" y="{height - pad - h:.1f}" width="{bar:.1f}"'
                f' height="{h:.1f}" fill="{color}"><title>{i * step:.2f}-{(i + 1) * step:.2f} ms:'
                f" {share:.1%}</title></rect>"
            )
    ticks = []
    for i in range(0, _BINS + 1, 5):
        x = pad + i * slot
        ticks.append(
            f'<text x="{x:.1f}" y="{height - pad + 16}" font-size="11" text-anchor="middle">'
            f"{i * step:.1f}</text>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="latency histograms">'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="#888"/>'
        + "".join(parts)
        + "".join(ticks)
        + f'<text x="{width / 2}" y="{height - 6}" font-size="12" text-anchor="middle">ms '
        f"(share of each side's requests per bin; the axis ends at the 99th percentile)"
        "</text></svg>"
    )


def _bars_svg(counts: dict[str, int], color: str) -> str:
    items = list(counts.items())[:25]
    peak = max(v for _, v in items) or 1
    label_w, width, row = 360, 900, 22
    height = row * len(items) + 10
    parts = []
    for i, (name, value) in enumerate(items):
        y = 5 + i * row
        w = (width - label_w - 60) * value / peak
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 15}" font-size="12" text-anchor="end">'
            f"{escape(name[:60])}</text>"
            f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{color}"/>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 15}" font-size="12">{value}</text>'
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="differences">{"".join(parts)}</svg>'
    )


def _worst(pairs: list[dict[str, Any]]) -> str:
    if not pairs:
        return "<p>No answer differs.</p>"
    rows = []
    for pair in pairs:
        comparison = pair["comparison"]
        diffs = "".join(
            f"<li><code>{escape(d['path'])}</code> {escape(d['kind'])}: "
            f"{escape(json.dumps(d.get('reference')))} → {escape(json.dumps(d.get('candidate')))}"
            f"{' (' + escape(d['detail']) + ')' if d.get('detail') else ''}</li>"
            for d in comparison["differences"]
        )
        rows.append(
            f"<tr><td>{escape(pair['id'])}<br><small>{escape(pair['where'])}</small></td>"
            f"<td>{pair['recorded']['status']} → {pair['replayed']['status']}<br>"
            f"{_plural(comparison['difference_count'], 'difference')}<ul>{diffs}</ul></td>"
            f"<td><pre>{escape(pair['recorded']['body'])}</pre></td>"
            f"<td><pre>{escape(pair['replayed']['body'])}</pre></td></tr>"
        )
    return (
        "<table><tr><th>request</th><th>differences</th><th>recorded answer</th>"
        f"<th>replayed answer</th></tr>{''.join(rows)}</table>"
    )


def _places(report: dict[str, Any]) -> str:
    items = [f"<li>{escape(p['reason'])} at {escape(p['where'])}: {escape(p['detail'])}</li>"
             for p in report["skipped_places"]]  # fmt: skip
    items += [f"<li>{escape(f['kind'])} for {escape(f['id'])} ({escape(f['where'])}): "
              f"{escape(f['message'])}</li>" for f in report["failures"]]  # fmt: skip
    if not items:
        return ""
    return f"<h2>Skipped and failed (the first few)</h2><ul>{''.join(items)}</ul>"
