"""Present benchmark results: one table per run, an on/off comparison, JSON and a PNG chart.

Performance figures are only compared as ratios of two runs measured side by side on the
same machine with the same workload; absolute TTFT on a shared CPU box means little.
matplotlib is imported only to draw the chart, and its absence only skips the chart.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdconnect.bench.loadgen import RunResult, StepResult, percentile

__all__ = [
    "Comparison",
    "ScenarioTotals",
    "compare",
    "format_comparison",
    "format_run",
    "format_table",
    "write_chart",
    "write_json",
]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _tokens(value: float, measured: bool = True) -> str:
    return f"{value:.0f}" if measured and not math.isnan(value) else "-"


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


RUN_HEADERS = (
    "scenario",
    "step",
    "ok",
    "D-local hit",
    "D-external hit",
    "P-local hit",
    "slack blocks",
    "TTFT mean",
    "TTFT p99",
    "TPOT mean",
    "ITL p99",
    "req/s",
)
# With a colocated reference engine, its local hit goes right after decode's.
REFERENCE_HEADER = "colocated hit"


def _run_row(s: StepResult, with_reference: bool = False) -> list[str]:
    d, p = s.decode, s.prefill
    reference = [_tokens(s.reference.cache.hits, s.reference.engines > 0)] if with_reference else []
    return [
        s.scenario,
        s.step,
        f"{s.ok}/{s.requests}",
        _tokens(d.cache.hits, d.engines > 0),
        *reference,
        _tokens(d.cache.external_hits, d.engines > 0),
        _tokens(p.cache.hits, p.engines > 0),
        _tokens(d.slack_blocks_published, d.engines > 0),
        _ms(s.ttft_mean_s),
        _ms(s.ttft_p99_s),
        _ms(s.tpot_mean_s),
        _ms(s.itl_p99_s),
        _rate(s.request_throughput),
    ]


def format_run(run: RunResult) -> str:
    """The run's title line, its table, and a line per step that had failures or fallbacks."""
    title = run.label + (f", transport in use: {run.transport}" if run.transport else "")
    with_reference = any(s.reference.engines for s in run.steps)
    headers = list(RUN_HEADERS)
    if with_reference:
        headers.insert(headers.index("D-local hit") + 1, REFERENCE_HEADER)
    lines = [title, format_table(headers, [_run_row(s, with_reference) for s in run.steps], left=2)]
    for s in run.steps:
        if s.failed or s.fallbacks:
            first = f"; first error: {s.errors[0]}" if s.errors else ""
            lines.append(f"! {s.scenario} {s.step}: {s.failed} failed, {s.fallbacks} decode-only fallbacks{first}")
        if s.reference_same_outputs is not None and s.reference_same_outputs < s.requests:
            lines.append(
                f"! {s.scenario} {s.step}: {s.requests - s.reference_same_outputs} of {s.requests} "
                "answers differ from the colocated engine's"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Comparing two runs


@dataclass(frozen=True)
class ScenarioTotals:
    """One scenario's steps of one run, added up (TTFTs pooled, throughput over total time)."""

    scenario: str
    requests: int
    ok: int
    decode_local_hits: float
    decode_external_hits: float
    prefill_local_hits: float
    ttft_mean_s: float
    ttft_p99_s: float
    request_throughput: float
    # NaN when no step had a colocated reference engine.
    reference_local_hits: float = math.nan

    @classmethod
    def of(cls, scenario: str, steps: Sequence[StepResult]) -> ScenarioTotals:
        ttfts = [t for s in steps for t in s.ttft_s]
        ok = sum(s.ok for s in steps)
        duration = sum(s.duration_s for s in steps)
        referenced = [s for s in steps if s.reference.engines]
        return cls(
            scenario=scenario,
            requests=sum(s.requests for s in steps),
            ok=ok,
            decode_local_hits=sum(s.decode.cache.hits for s in steps),
            decode_external_hits=sum(s.decode.cache.external_hits for s in steps),
            prefill_local_hits=sum(s.prefill.cache.hits for s in steps),
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
            ttft_p99_s=percentile(ttfts, 99),
            request_throughput=ok / duration if duration > 0 else math.nan,
            reference_local_hits=sum(s.reference.cache.hits for s in referenced) if referenced else math.nan,
        )


def _totals(run: RunResult) -> dict[str, ScenarioTotals]:
    """Per scenario, and for conversation scenarios also per turn ("multi-turn turn 2")."""
    groups: dict[str, list[StepResult]] = {}
    for s in run.steps:
        groups.setdefault(s.scenario, []).append(s)
        if s.turn > 0:
            groups.setdefault(f"{s.scenario} turn {s.turn}", []).append(s)
    return {name: ScenarioTotals.of(name, steps) for name, steps in groups.items()}


# (label, attribute, formatter) of each compared figure, in table order.
_METRICS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("D-local hit tokens", "decode_local_hits", _tokens),
    ("colocated hit tokens", "reference_local_hits", _tokens),
    ("D-external hit tokens", "decode_external_hits", _tokens),
    ("P-local hit tokens", "prefill_local_hits", _tokens),
    ("TTFT mean", "ttft_mean_s", _ms),
    ("TTFT p99", "ttft_p99_s", _ms),
    ("request throughput (req/s)", "request_throughput", _rate),
)


@dataclass(frozen=True)
class Comparison:
    """The same figure of the same scenario in two runs, and their ratio a/b."""

    scenario: str
    metric: str
    a: float
    b: float

    @property
    def ratio(self) -> float:
        if math.isnan(self.a) or math.isnan(self.b) or (self.a == 0 and self.b == 0):
            return math.nan
        return math.inf if self.b == 0 else self.a / self.b


def compare(a: RunResult, b: RunResult) -> list[Comparison]:
    """Every figure of every scenario both runs have, `a` against `b` (figures neither
    run measured, like the colocated hit without a reference engine, are left out)."""
    mine, theirs = _totals(a), _totals(b)
    return [
        Comparison(name, attr, getattr(mine[name], attr), getattr(theirs[name], attr))
        for name in mine
        if name in theirs
        for _, attr, _ in _METRICS
        if not (math.isnan(getattr(mine[name], attr)) and math.isnan(getattr(theirs[name], attr)))
    ]


def _ratio(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def format_comparison(a: RunResult, b: RunResult) -> str:
    """A table of `a` vs `b` per scenario and figure, with the ratio a/b."""
    labels = {attr: (label, fmt) for label, attr, fmt in _METRICS}
    rows, previous = [], None
    for c in compare(a, b):
        label, fmt = labels[c.metric]
        rows.append([c.scenario if c.scenario != previous else "", label, fmt(c.a), fmt(c.b), _ratio(c.ratio)])
        previous = c.scenario
    return format_table(("scenario", "figure", a.label, b.label, "ratio"), rows, left=2)


# ---------------------------------------------------------------------------------------
# Files


def _json_safe(value: Any) -> Any:
    """NaN and infinity are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, runs: Sequence[RunResult], extra: dict[str, Any] | None = None) -> None:
    """Every run (raw per-request TTFTs included) and, for two runs, their comparison."""
    data: dict[str, Any] = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
        "runs": [r.to_json() for r in runs],
    }
    if len(runs) == 2:
        data["comparison"] = [
            {"scenario": c.scenario, "metric": c.metric, runs[0].label: c.a, runs[1].label: c.b, "ratio": c.ratio}
            for c in compare(*runs)
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")


def write_chart(path: Path, runs: Sequence[RunResult], title: str) -> bool:
    """Bars per scenario and run: decode hit tokens (local, external) and TTFT mean.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    totals = [_totals(r) for r in runs]
    scenarios = list(dict.fromkeys(name for t in totals for name in t))
    panels = (
        ("decode-local hit tokens", "decode_local_hits", 1.0),
        ("decode external hit tokens", "decode_external_hits", 1.0),
        ("TTFT mean (ms)", "ttft_mean_s", 1000.0),
    )
    # Horizontal bars: scenario names ("multi-turn turn 2", "prefix-repetition") are long,
    # and as x-axis labels under grouped bars they ran into each other. One label column,
    # shared by the panels, reads at any number of scenarios.
    height = 0.8 / max(len(runs), 1)
    fig, axes = plt.subplots(
        1, len(panels), sharey=True, figsize=(4.2 * len(panels), 1.2 + 0.5 * len(scenarios) * max(len(runs), 1) ** 0.5)
    )
    for ax, (label, attr, scale) in zip(axes, panels, strict=True):
        for i, (run, total) in enumerate(zip(runs, totals, strict=True)):
            values = [getattr(total[s], attr) * scale if s in total else 0.0 for s in scenarios]
            positions = [y + (i - (len(runs) - 1) / 2) * height for y in range(len(scenarios))]
            bars = ax.barh(positions, [0.0 if math.isnan(v) else v for v in values], height, label=run.label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_title(label, fontsize=10)
        ax.set_yticks(range(len(scenarios)), scenarios, fontsize=8)
        ax.margins(x=0.2)
    axes[0].invert_yaxis()  # first scenario on top, as in the tables
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
