"""The chart's alerts under promtool: `check rules` on the rendered PrometheusRule, and
`test rules` with tests/chart/alerts.test.yaml (a firing and a quiet case per alert)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.chart.helpers import CHART, HELM, ROOT, one, render, tool

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


def runbook_sections() -> set[str]:
    """The anchors of docs/runbooks.md's sections (mkdocs' toc slugs of its `## ` headings)."""
    from markdown.extensions.toc import slugify
    text = (ROOT / "docs" / "runbooks.md").read_text()
    return {slugify(line[3:].strip(), "-") for line in text.splitlines() if line.startswith("## ")}


def test_every_alert_links_its_own_runbook_section(tmp_path):
    """runbook_url on every alert: the documentation site (Chart.yaml's home, mkdocs.yml's
    site_url: one URL) + runbooks/ + the alert's section, which exists; every section is an alert's."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0])["site_url"]
    assert chart["home"] == site
    rule, path = rendered_rules(tmp_path)
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    sections = runbook_sections()
    for alert in alerts:
        url = alert["annotations"].get("runbook_url")
        assert url == f"{site}runbooks/#{alert['alert'].lower()}", (alert["alert"], url)
        assert url.rsplit("#", 1)[1] in sections, f"{alert['alert']}: no section in docs/runbooks.md"
    assert sections == {a["alert"].lower() for a in alerts}
    # the rendering with the runbook links still passes promtool (annotations are checked as templates)
    res = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_runbook_base_url_is_a_value_and_a_bad_one_is_refused():
    rule = one(render({"prometheusRule.enabled": True,
                       "prometheusRule.runbookBaseUrl": "https://wiki.example.com/ml/runbooks.md"}), "PrometheusRule")
    urls = {r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "https://wiki.example.com/ml/runbooks.md#trainingrunfailed" in urls
    res = subprocess.run([str(HELM), "template", "t", str(CHART), "--set", "prometheusRule.enabled=true",
                          "--set", "prometheusRule.runbookBaseUrl=wiki/runbooks"], capture_output=True, text=True)
    assert res.returncode != 0 and "runbookBaseUrl" in res.stderr, res.stderr
