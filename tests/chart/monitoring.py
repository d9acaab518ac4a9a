"""The chart's monitoring under test: Debian's Prometheus (a real server, its own process) and
the Grafana dashboard's queries, expanded as Grafana expands them.

The chart tier scrapes the operator (tests/chart/test_install.py); the e2e tier scrapes the
operator, the trainers' pods (found through the API server, as the chart's PodMonitor finds
them) and neuron-monitor's stand-in (tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.chart.helpers import CHART, tool
from tests.conftest import wait_until

DASHBOARD = CHART / "files" / "dashboard.json"


def series_sources() -> dict[str, set[str]]:
    """The series the dashboard may read, by who exports them: the operator, the trainer (each
    pod's local rank 0), neuron-monitor's exporter (its names, recorded in the stand-in)."""
    from prometheus_client import CollectorRegistry

    from tests.standins import neuron_monitor
    from trainer.model.metrics import TrainerMetrics
    from trainium_operator import metrics

    def names(registry: CollectorRegistry) -> set[str]:
        out = set()
        for family in registry.collect():
            out.add(family.name)
            if family.type == "counter":
                out.add(family.name + "_total")
            if family.type == "histogram":
                out.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        return out

    trainer = TrainerMetrics(0, {"run": "r", "node_rank": "0"})
    return {"operator": names(metrics.Metrics().registry), "trainer": names(trainer.registry),
            "neuron-monitor": set(neuron_monitor.SERIES)}


def series_in(expr: str, known: set[str]) -> set[str]:
    """The series names an expression reads (of ``known``, and any trainium_*/trainer_* name)."""
    words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b", expr))
    return {w for w in words if w in known or w.startswith(("trainium_", "trainer_"))}


def dashboard_queries(namespace: str, sources: set[str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) with the dashboard's variables as Grafana would expand them; with
    ``sources``, only the panels whose series all come from those exporters."""
    dash = json.loads(DASHBOARD.read_text())
    by_source = series_sources()
    allowed = set().union(*(by_source[s] for s in sources)) if sources else None
    known = set().union(*by_source.values())
    subst = {"$namespace": namespace, "$run": ".*", "$__rate_interval": "2m", "$__range": "10m"}
    out = []
    for p in dash["panels"]:
        targets = p.get("targets", [])
        if allowed is not None and not all(series_in(t["expr"], known) <= allowed for t in targets):
            continue
        for t in targets:
            expr = t["expr"]
            for k, v in subst.items():
                expr = expr.replace(k, v)
            assert "$" not in expr, f"{p['title']}: unexpanded variable in {expr}"
            out.append((p["title"], expr))
    return out


class PodTargets:
    """Prometheus HTTP service discovery of the trainers' pods: what the chart's PodMonitor
    selects (templates/podmonitor.yaml: the operator's pods with a trainium.dev/run label, their
    port named "metrics"), with the labels the Prometheus operator gives such targets (namespace,
    pod, container; run and attempt from the pod's labels). A stand-in for Prometheus' own
    Kubernetes discovery, which Debian's build leaves out (its config refuses
    kubernetes_sd_configs); the pods come from the API server, as there."""

    def __init__(self, core_api, namespace: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        targets = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                """Quiet: Prometheus asks every second."""

            def do_GET(self):
                body = json.dumps(targets.groups()).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Prometheus gave up on a slow answer; it asks again in a second

        self.core, self.namespace = core_api, namespace
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def groups(self) -> list[dict]:
        out = []
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector="trainium.dev/run").items:
            labels = pod.metadata.labels or {}
            if labels.get("app.kubernetes.io/managed-by") != "trainium-operator" or not pod.status.pod_ip:
                continue
            for c in pod.spec.containers:
                for port in c.ports or []:
                    if port.name == "metrics":
                        out.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                                    "labels": {"namespace": self.namespace, "pod": pod.metadata.name,
                                               "container": c.name, "run": labels["trainium.dev/run"],
                                               "attempt": labels.get("trainium.dev/attempt", "")}})
        return out

    def scrape_config(self) -> dict:
        return {"job_name": "trainers", "http_sd_configs": [{"url": self.url, "refresh_interval": "1s"}]}

    def close(self) -> None:
        self.server.shutdown()


OPERATOR_NAMESPACE = "trainium-system"  # where the chart runs the operator (not a run's namespace)


def operator_scrape(port: int) -> dict:
    """The operator's target as the Prometheus operator makes it from the chart's ServiceMonitor:
    the labels it gives every target (the operator pod's namespace, pod, service, endpoint,
    container) and the endpoint's honorLabels, read from the rendered chart, so a ServiceMonitor
    that let those labels replace the series' own (a run's namespace) fails the tests."""
    from tests.chart.helpers import ALL_ON, one, render
    endpoint = one(render(ALL_ON, namespace=OPERATOR_NAMESPACE), "ServiceMonitor")["spec"]["endpoints"][0]
    return {"job_name": "trainium-operator", "honor_labels": bool(endpoint.get("honorLabels", False)),
            "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                "labels": {"namespace": OPERATOR_NAMESPACE, "pod": "trainium-operator-7d9f-abcde",
                                           "service": "trainium-operator", "endpoint": endpoint["port"],
                                           "container": "operator"}}]}


class Prometheus:
    """Debian's prometheus on loopback, scraping every second: the operator at ``target_port`` (as
    the chart's ServiceMonitor has it scraped), and ``scrapes`` (more scrape_configs entries)."""

    def __init__(self, workdir: Path, target_port: int, rules: Path | None = None, scrapes: list[dict] = ()):
        from localcluster.cluster import free_base_port
        self.port = free_base_port(start=19090, span=1)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(rules)] if rules else [],
                  "scrape_configs": [operator_scrape(target_port), *scrapes]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run([tool("promtool"), "check", "config", str(workdir / "prometheus.yml")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen([tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: self._ready(), timeout=60, what="prometheus ready")

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            body = urllib.request.urlopen(url, timeout=10).read()
        except urllib.error.HTTPError as err:  # 400 = the query does not parse
            body = err.read()
        return json.loads(body)

    def query(self, expr: str, at: float | None = None) -> dict:
        return self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))

    def value(self, expr: str) -> float | None:
        res = self.query(expr)["data"]["result"]
        return float(res[0]["value"][1]) if res else None

    def empty_panels(self, namespace: str, sources: set[str] | None = None, at: float | None = None,
                     show: bool = True) -> list[str]:
        """Every dashboard query (of ``sources``' panels) at ``at``: the ones that fail or return
        no number, described; the others printed with their range."""
        import math
        failures = []
        for title, expr in dashboard_queries(namespace, sources):
            res = self.query(expr, at)
            if res.get("status") != "success":
                failures.append(f"{title}: {expr}: {res.get('error')}")
                continue
            values = [float(r["value"][1]) for r in res["data"]["result"]]
            if not any(not math.isnan(v) for v in values):
                failures.append(f"{title}: {expr}: no data ({res['data']['result']})")
            elif show:
                print(f"  {title:38s} {min(values):12.3f} .. {max(values):12.3f}  ({len(values)} series)")
        return failures

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()
