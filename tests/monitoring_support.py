"""The shipped alert rules and Grafana dashboard, read for the monitoring checks: their queries and metric names.

`tests/test_monitoring.py` checks the rules and the dashboard on their own (promtool);
`tests/test_router_engines.py` checks every metric name they use against what a real
router and real engines export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ALERTS",
    "DASHBOARD",
    "alert_queries",
    "alert_rules",
    "dashboard_queries",
    "dashboard_variable_queries",
    "metric_names_in",
    "missing_metrics",
]

_COMPONENT = Path(__file__).resolve().parents[1] / "deploy" / "components" / "servicemonitor"
ALERTS = _COMPONENT / "alerts.yaml"
DASHBOARD = _COMPONENT / "dashboard.json"

# A metric selected by name: pdconnect's router (`pdconnect_router_...`) and connector
# (`pdconnect:...`) series, and vLLM's (`vllm:...`).
_NAME = re.compile(r"\b(?:pdconnect_[a-z0-9_]+|pdconnect:[a-z0-9_]+|vllm:[a-z0-9_]+)")
# `{__name__=~"prefix(a|b)suffix"}`: one alternation of plain names.
_NAME_REGEX = re.compile(r'__name__=~"([a-z0-9_:]*)\(([a-z0-9_|]+)\)([a-z0-9_:]*)"')
# Suffixes a query adds to a family's name (counters, histograms).
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def alert_rules() -> list[dict[str, Any]]:
    """The rule groups of the shipped PrometheusRule, as `promtool` reads them."""
    rule = yaml.safe_load(ALERTS.read_text())
    assert rule["kind"] == "PrometheusRule", rule["kind"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alert_queries() -> list[str]:
    """Every alert's expression."""
    return [rule["expr"] for group in alert_rules() for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard's panels, Grafana's variables left in."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def dashboard_variable_queries() -> list[str]:
    """The dashboard variables' queries (Grafana's `label_values(...)`, not PromQL)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]


def metric_names_in(query: str) -> set[str]:
    """The metric names a query selects, each `__name__` alternation spelled out."""
    names = {
        prefix + alternative + suffix
        for prefix, alternatives, suffix in _NAME_REGEX.findall(query)
        for alternative in alternatives.split("|")
    }
    return names | set(_NAME.findall(_NAME_REGEX.sub("", query)))


def missing_metrics(used: set[str], exported: set[str]) -> set[str]:
    """The names in `used` that match no family or sample name in `exported`."""

    def family(name: str) -> str:
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name

    families = {family(name) for name in exported}
    return {name for name in used if name not in exported and family(name) not in families}
