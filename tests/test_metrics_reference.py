"""docs/metrics.md, the Grafana dashboard and the alert rules name only metrics that exist.

Shoal's metrics are read from the registries its components build
(`shoal.observability.metrics`); every PromQL expression in deploy/grafana and
deploy/prometheus is parsed with a real PromQL parser (`promql-parser`), and each metric,
label matcher and grouping label it uses must be one those registries export, or one of the
NATS exporter's JetStream metrics that docs/metrics.md lists. promtool, where installed,
checks the rule file and runs its unit tests (deploy/prometheus/alerts.test.yaml).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from shoal.observability.metrics import GatewayMetrics, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
# Labels Prometheus attaches to every series from the scrape target, not the exporter.
TARGET_LABELS = {"instance", "job", "pod", "namespace", "container", "node"}
# Grafana's variables, replaced by values of the right kind before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$model": ".*"}


@dataclass(frozen=True)
class Family:
    """One metric family as Prometheus sees it: its type, labels and sample names."""

    name: str
    type: str
    labels: frozenset[str]
    samples: frozenset[str]


def _families(registry: CollectorRegistry) -> list[Family]:
    # The registry's own record of what each collector exposes: labelled metrics have no
    # samples before their first use, so the collected output would miss them.
    out = []
    for collector, names in registry._collector_to_names.items():
        out.append(
            Family(
                name=collector._name,
                type=collector._type,
                labels=frozenset(collector._labelnames),
                samples=frozenset(n for n in names if not n.endswith("_created")),
            )
        )
    return out


def shoal_families() -> dict[str, Family]:
    families = _families(GatewayMetrics().registry)
    families += _families(WorkerMetrics("m", "torch", simulated=False).registry)
    return {f.name: f for f in families}


def _doc_tables() -> dict[str, list[list[str]]]:
    """The rows of each table in docs/metrics.md, by the section they are in."""
    tables: dict[str, list[list[str]]] = {}
    section = ""
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            tables.setdefault(section, []).append(cells)
    return tables


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", cell))


def external_metrics() -> dict[str, frozenset[str]]:
    """The NATS exporter's metrics that docs/metrics.md lists, with the labels it documents
    (`same` in the labels column: those of the table's first row)."""
    rows = _doc_tables()["JetStream metrics from the NATS exporter"]
    first_labels = _names(rows[0][2])
    documented = {}
    for name, _type, labels, _meaning in rows:
        (metric,) = _names(name)
        documented[metric] = frozenset(first_labels if labels == "same" else _names(labels))
    return documented


def allowed_series() -> dict[str, frozenset[str]]:
    """Every series name a query may select, with the labels it may match or group by."""
    allowed: dict[str, frozenset[str]] = {}
    for family in shoal_families().values():
        for sample in family.samples:
            extra = {"le"} if sample.endswith("_bucket") else set()
            allowed[sample] = family.labels | extra | TARGET_LABELS
    for name, labels in external_metrics().items():
        allowed[name] = labels | TARGET_LABELS
    return allowed


def test_docs_describe_every_exported_metric_with_its_type_and_labels() -> None:
    families = shoal_families()
    tables = _doc_tables()
    rows = tables["Gateway"] + tables["Worker"]
    documented = {}
    for name, type_, labels, meaning in rows:
        (exposed,) = _names(name)
        documented[exposed] = (type_, _names(labels), meaning)
    expected = {}
    for family in families.values():
        exposed = family.name + ("_total" if family.type == "counter" else "")
        expected[exposed] = (family.type, set(family.labels))
    assert set(documented) == set(expected), "docs/metrics.md and the code disagree"
    for exposed, (type_, labels) in expected.items():
        assert documented[exposed][:2] == (type_, labels), exposed
        assert len(documented[exposed][2]) > 20, f"{exposed}: say what it means"
    # The gateway and worker tables split where the registries do.
    gateway = {f.name for f in _families(GatewayMetrics().registry)}
    assert {n.removesuffix("_total") for r in tables["Gateway"] for n in _names(r[0])} == gateway


def _queries() -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) for every query of the dashboard and every alert rule."""
    queries = []
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append(
                (f"panel {panel['title']!r}", target["expr"], target.get("legendFormat", ""))
            )
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            queries.append((f"alert {rule['alert']}", rule["expr"], ""))
    return queries


def _substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def _selectors(node: Any) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(n: Any) -> None:
        if isinstance(n, promql_parser.VectorSelector):
            found.append(n)

    promql_parser.walk(node, pre_visit=visit)
    return found


def _aggregations(node: Any) -> list[promql_parser.AggregateExpr]:
    found: list[promql_parser.AggregateExpr] = []

    def visit(n: Any) -> None:
        if isinstance(n, promql_parser.AggregateExpr):
            found.append(n)

    promql_parser.walk(node, pre_visit=visit)
    return found


def test_dashboard_and_alerts_use_only_exported_metrics_and_labels() -> None:
    allowed = allowed_series()
    queries = _queries()
    assert len(queries) >= 20
    used: set[str] = set()
    for where, expr, legend in queries:
        ast = promql_parser.parse(_substitute(expr))
        selectors = _selectors(ast)
        assert selectors, f"{where}: no metric in {expr}"
        for selector in selectors:
            assert selector.name in allowed, f"{where}: {selector.name} is not exported"
            used.add(selector.name)
            for matcher in selector.matchers.matchers:
                assert matcher.name in allowed[selector.name], (
                    f"{where}: {selector.name} has no label {matcher.name}"
                )
        for aggregation in _aggregations(ast):
            if aggregation.modifier is None:
                continue
            inside = set().union(*(allowed[s.name] for s in _selectors(aggregation.expr)))
            missing = set(aggregation.modifier.labels) - inside
            assert not missing, f"{where}: grouped by {missing}, which its metrics lack"
        legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        in_query = set().union(*(allowed[s.name] for s in selectors))
        assert legend_labels <= in_query, f"{where}: legend {legend!r}"
    # The dashboard and alerts watch each side: gateway, workers, generation, the queue.
    for needed in (
        "shoal_gateway_requests_total",
        "shoal_gateway_request_seconds_bucket",
        "shoal_worker_busy_fraction",
        "shoal_worker_batch_items_bucket",
        "shoal_worker_queue_wait_seconds_bucket",
        "shoal_worker_first_token_seconds_bucket",
        "nats_consumer_num_pending",
    ):
        assert needed in used, needed


def test_the_reference_check_rejects_an_unknown_metric_and_label() -> None:
    """The checker is not vacuous: a made-up metric or label is not in the allowed set."""
    allowed = allowed_series()
    (selector,) = _selectors(promql_parser.parse('rate(shoal_worker_item_total{model="m"}[5m])'))
    assert selector.name not in allowed
    assert "route" not in allowed["shoal_worker_items_total"]
    assert "le" in allowed["shoal_gateway_request_seconds_bucket"]
    assert "le" not in allowed["shoal_gateway_request_seconds_count"]


def test_dashboard_has_fleet_model_worker_and_queue_rows_laid_out_without_overlap() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Fleet", "Per model", "Per worker", "Queue"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model"}
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
    model_query = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", model_query["query"]["query"])
    assert match and match.group(2) in allowed_series()[match.group(1)]


def test_alert_rules_cover_the_failure_modes_and_say_what_to_do() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {
        "ShoalBacklogGrowing",
        "ShoalModelUnserved",  # what failing model loads look like from the queue
        "ShoalErrorRateHigh",
        "ShoalLatencyP99High",
    } <= names
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert re.fullmatch(r"\d+m", rule["for"]), rule["alert"]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    return found


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    promtool = _promtool()
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(
        [promtool, "test", "rules", "alerts.test.yaml"],
        cwd=ALERTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
