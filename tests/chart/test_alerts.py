"""The chart's alerts under promtool: `check rules` on the rendered PrometheusRule, and
`test rules` with tests/chart/alerts.test.yaml (a firing and a quiet case per alert)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.chart.helpers import one, render, tool

pytestmark = pytest.mark.chart

TESTS = Path(__file__).with_name("alerts.test.yaml")


def rendered_rules(tmp_path):
    rule = one(render({"prometheusRule.enabled": True}), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return rule, path


def test_promtool_check_rules(tmp_path):
    rule, path = rendered_rules(tmp_path)
    res = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    rendered = sum(len(group["rules"]) for group in rule["spec"]["groups"])
    assert rendered >= 8 and f"SUCCESS: {rendered} rules found" in res.stdout


def test_promtool_unit_tests_cover_every_alert_firing_and_quiet(tmp_path):
    rule, _ = rendered_rules(tmp_path)
    shutil.copy(TESTS, tmp_path / TESTS.name)
    res = subprocess.run([tool("promtool"), "test", "rules", TESTS.name], cwd=tmp_path, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    for alert in (r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]):
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert}: no firing case"
        assert any(not c["exp_alerts"] for c in mine), f"{alert}: no quiet case"
