"""The shipped alert rules and Grafana dashboard: promtool checks them and fires each alert on written series.

The rules live in `deploy/components/servicemonitor/alerts.yaml` (a PrometheusRule), the
dashboard in `dashboard.json` beside it. `promtool` (Prometheus 2.42, from Debian's
package, installed into the tools venv by `make deploy-tools`) checks the rules' syntax
and templates, and `promtool test rules` evaluates each alert over series written here
by hand: it fires when it should, and not on the look-alike that is fine. Whether every
metric name they use is really exported is checked against a real router and real
engines in `tests/test_router_engines.py`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_support import deploy_tool, require_tools_venv
from tests.monitoring_support import DASHBOARD, alert_rules, dashboard_queries, metric_names_in, missing_metrics

NS = 'namespace="pd"'


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    require_tools_venv()
    return subprocess.run(
        [deploy_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def _write_rules(path: Path, groups: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_accepts_the_alert_rules(tmp_path: Path) -> None:
    rules = _write_rules(tmp_path / "rules.yaml", alert_rules())
    proc = _promtool("check", "rules", str(rules), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 6 rules found" in proc.stdout, proc.stdout


def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a rule with a bad expression is refused."""
    groups = alert_rules()
    groups[0]["rules"][0]["expr"] = "max by (engine (pdconnect_router_engine_healthy)"
    proc = _promtool("check", "rules", str(_write_rules(tmp_path / "rules.yaml", groups)), cwd=tmp_path)
    assert proc.returncode != 0


def _warns_for_one_pod(alert: str, counter: str, at: str, **pods: str) -> dict[str, Any]:
    """A per-pod warning's case: `pdconnect:<counter>` of each pod (its promtool values); at
    `at` the alert fires for the first pod alone."""
    firing, *quiet = pods
    series = [{"series": f'pdconnect:{counter}{{{NS},pod="{pod}"}}', "values": v} for pod, v in pods.items()]
    return {
        "name": f"{alert} fires for {firing}, not for {', '.join(quiet)}",
        "input_series": series,
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": [_warning_for(firing)]}],
    }


def _warning_for(pod: str) -> dict[str, Any]:
    return {"exp_labels": {"severity": "warning", "namespace": "pd", "pod": pod}}


# Each alert over series that must fire it, and series that must not. Times are minutes
# of a 1-minute evaluation; labels are the alert's own (annotations are left out of the
# comparison: their templates are checked by `promtool check rules`).
CASES: list[dict[str, Any]] = [
    {
        "name": "engine down on every replica fires, on one replica does not",
        "input_series": [
            {
                "series": f'pdconnect_router_engine_healthy{{{NS},pod="r0",role="decode",engine="http://d0:8000"}}',
                "values": "1 1 0x10",
            },
            {
                "series": f'pdconnect_router_engine_healthy{{{NS},pod="r1",role="decode",engine="http://d0:8000"}}',
                "values": "1 1 0x10",
            },
            {
                "series": f'pdconnect_router_engine_healthy{{{NS},pod="r0",role="decode",engine="http://d1:8000"}}',
                "values": "1 1 0x10",
            },
            {
                "series": f'pdconnect_router_engine_healthy{{{NS},pod="r1",role="decode",engine="http://d1:8000"}}',
                "values": "1 1 1x10",
            },
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "PDConnectEngineDown", "exp_alerts": []},
            {
                "eval_time": "6m",
                "alertname": "PDConnectEngineDown",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "namespace": "pd",
                            "role": "decode",
                            "engine": "http://d0:8000",
                        }
                    }
                ],
            },
        ],
    },
    # A steady rate of failed loads fires; one failure does not.
    _warns_for_one_pod("PDConnectFailedLoads", "transfer_failures_total", "20m", d0="0+12x30", d1="0 1x30"),
    # Leases running out fire; a few now and then do not.
    _warns_for_one_pod("PDConnectLeaseExpiries", "lease_expiries_total", "20m", p0="0+1x30", p1="0 0 1 1 2x30"),
    {
        "name": "blocks held on an idle engine fire; on a busy one they do not",
        "input_series": [
            {"series": f'pdconnect:blocks_held{{{NS},pod="p0"}}', "values": "4x30"},
            {"series": f'vllm:num_requests_running{{{NS},pod="p0"}}', "values": "0x30"},
            {"series": f'vllm:num_requests_waiting{{{NS},pod="p0"}}', "values": "0x30"},
            {"series": f'pdconnect:blocks_held{{{NS},pod="p1"}}', "values": "4x30"},
            {"series": f'vllm:num_requests_running{{{NS},pod="p1"}}', "values": "1x30"},
            {"series": f'vllm:num_requests_waiting{{{NS},pod="p1"}}', "values": "0x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "PDConnectBlocksHeldWhileIdle", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "PDConnectBlocksHeldWhileIdle",
                "exp_alerts": [{"exp_labels": {"severity": "critical", "namespace": "pd", "pod": "p0"}}],
            },
        ],
    },
    {
        "name": "one decode-first prediction in ten missing fires",
        "input_series": [
            {
                "series": f'pdconnect_router_decode_local_hit_checks_total{{{NS},pod="r0",result="match"}}',
                "values": "0+90x40",
            },
            {
                "series": f'pdconnect_router_decode_local_hit_checks_total{{{NS},pod="r0",result="over"}}',
                "values": "0+10x40",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "35m",
                "alertname": "PDConnectMispredictions",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": "pd"}}],
            },
        ],
    },
    {
        "name": "refused side-channel messages fire",
        "input_series": [
            {"series": f'pdconnect:side_channel_refused_stale_total{{{NS},pod="p0"}}', "values": "0+5x20"},
            {"series": f'pdconnect:side_channel_received_total{{{NS},pod="p1"}}', "values": "0+500x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "PDConnectSideChannelRefusals", "exp_alerts": [_warning_for("p0")]},
        ],
    },
]


def _without_annotations(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**group, "rules": [{k: v for k, v in rule.items() if k != "annotations"} for rule in group["rules"]]}
        for group in groups
    ]


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_each_alert_fires_on_the_series_it_watches(case: dict[str, Any], tmp_path: Path) -> None:
    _write_rules(tmp_path / "rules.yaml", _without_annotations(alert_rules()))
    spec = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": case["input_series"], "alert_rule_test": case["alert_rule_test"]}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = _promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_case() -> None:
    alerts = {rule["alert"] for group in alert_rules() for rule in group["rules"]}
    tested = {t["alertname"] for case in CASES for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == tested


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel's query, Grafana's variables filled in, checked by promtool as a recording rule."""
    filled = [q.replace("$__rate_interval", "5m").replace('=~"$namespace"', '=~".*"') for q in dashboard_queries()]
    assert not [q for q in filled if "$" in q], filled
    rules = [{"record": f"pdconnect:dashboard_query_{i}", "expr": q} for i, q in enumerate(filled)]
    proc = _promtool(
        "check", "rules", str(_write_rules(tmp_path / "q.yaml", [{"name": "q", "rules": rules}])), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_panels_each_query_the_chosen_data_source() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    covered = " ".join(dashboard_queries())
    # Routes and reasons, hits, pulls, leases, failures, TTFT: what the dashboard is for.
    for name in (
        "decode_routes",
        "prefix_cache_hits",
        "transfers_total",
        "lease_expiries",
        "transfer_failures",
        "time_to_first_token",
    ):
        assert name in covered, name


def test_metric_names_are_read_out_of_queries() -> None:
    query = (
        'sum(rate({__name__=~"pdconnect:(a_b|c)_total",namespace=~"x"}[5m])) '
        "/ on (pod) vllm:num_requests_running + histogram_quantile(0.5, pdconnect_router_x_bucket)"
    )
    assert metric_names_in(query) == {
        "pdconnect:a_b_total",
        "pdconnect:c_total",
        "vllm:num_requests_running",
        "pdconnect_router_x_bucket",
    }


def test_a_misspelled_metric_is_missing() -> None:
    exported = {"pdconnect:transfers", "pdconnect:transfers_total", "vllm:time_to_first_token_seconds"}
    used = {"pdconnect:transfers_total", "vllm:time_to_first_token_seconds_bucket", "pdconnect:transfer_total"}
    assert missing_metrics(used, exported) == {"pdconnect:transfer_total"}
