"""docs/metrics.md names every series the controller exports, and the Grafana dashboard in
docs/ queries only series that exist (a renamed metric breaks this test, not the dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from muster.controller.metrics import Metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


def exported() -> tuple[set[str], set[str]]:
    """(the series' documented names, every sample name a scrape can show)."""
    metrics = Metrics()
    metrics.jobs.labels("queued").set(1)
    metrics.frames_refused.labels("auth").inc()
    metrics.internal_errors.labels("link").inc()
    metrics.placement.observe(0.01)
    metrics.scheduler_pass.observe(0.02)
    metrics.log_lines.inc()
    metrics.relayed_bytes.inc(1)
    names, samples = set(), set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if family.name.endswith("_created"):  # (a counter's or histogram's start time)
            continue
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        samples |= {s.name for s in family.samples}
    return names, samples


def test_every_series_is_documented() -> None:
    names, _ = exported()
    documented = set(
        re.findall(r"^\| `(muster_[a-z_]+)` \|", (DOCS / "metrics.md").read_text(), re.M)
    )
    assert names == documented


def test_the_dashboard_queries_only_series_that_exist() -> None:
    _, samples = exported()
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bmuster_[a-z_]+", e)}
    assert used <= samples, used - samples
    names, _ = exported()
    # Every documented series has a panel.
    assert {n.removesuffix("_total") for n in names} <= {
        re.sub(r"_(bucket|count|sum|total)$", "", u) for u in used
    }
