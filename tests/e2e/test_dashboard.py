"""The chart's Grafana dashboard against a real Prometheus, through a real fault (tier e2e).

A run of real trainers (2 process-backed nodes x 2 ranks) loses a rank to SIGKILL and restarts in
place. Debian's Prometheus scrapes what it would scrape on EKS:
- the operator (its metrics port);
- the trainers' pods, found through the API server as the chart's PodMonitor finds them (pods of
  the operator with a trainium.dev/run label, their port named "metrics"), with its labels
  (tests/chart/monitoring.PodTargets: Debian's Prometheus is built without Kubernetes discovery);
- neuron-monitor's exporter on the run's nodes: a stand-in (tests/standins/neuron_monitor.py:
  no Trainium here) serving the exporter's own series for the nodes' EC2 instance ids, which
  the simulated nodes carry in spec.providerID as EKS nodes do.

Once the restarted gang trains again, every query of every panel must return data. Grafana
itself is not run: it is in neither Debian's archive nor PyPI (docs/install.md, "Dashboard").
"""

from __future__ import annotations

import time

import pytest

from localcluster import drill
from localcluster.cluster import free_base_port
from localcluster.drill import Drill
from localcluster.nodes import create_nodes
from tests.chart.monitoring import PodTargets, Prometheus
from tests.standins.neuron_monitor import NeuronMonitorStandIn

pytestmark = pytest.mark.e2e

FAULT_AT = 12
POOL = {"example.com/pool": "dashboard"}  # the test's own nodes (the others have no instance ids)


def test_every_dashboard_panel_has_data_through_a_fault(e2e, tiny_data, tmp_path):
    core = e2e.core
    nodes = create_nodes(core, 2, "cpu", "proc-dash-", processes=True)
    instances = {}
    prom = neuron = d = pod_targets = None
    try:
        for i, node in enumerate(nodes):
            instances[node] = f"i-0da5b0a4d00000{i:03d}"
            core.patch_node(node, {"metadata": {"labels": POOL},
                                   "spec": {"providerID": f"aws:///us-west-2d/{instances[node]}"}})
        ns = e2e.namespace("dashboard")
        body = drill.manifest("dash", tiny_data, tmp_path,
                              training={"steps": 2000},  # (stopped once checked)
                              checkpoint={"intervalSteps": 5, "keep": 100},
                              # a CPU has no published peak: this one makes MFU a number
                              logging={"interval": 5, "progressIntervalSeconds": 1, "peakFlops": 5e10},
                              podTemplate={"spec": {"nodeSelector": POOL}})
        body["spec"]["data"].update(heldOut=[{"uri": tiny_data["facts"]}], evalIntervalSteps=10)
        port = free_base_port(start=e2e.cluster.base_port + 450, span=1)
        neuron = NeuronMonitorStandIn(port, list(instances.values()))
        pod_targets = PodTargets(core, ns)
        prom = Prometheus(tmp_path, e2e.operator.metrics_port,
                          scrapes=[pod_targets.scrape_config(),
                                   {"job_name": "neuron-monitor", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}])
        d = Drill(e2e.cluster, ns, body)
        d.create()
        d.wait_step(FAULT_AT, 240)
        assert {p.spec.node_name for p in d.pods()} == set(nodes)
        d.inject("kill-rank", e2e.operator)
        sel = f'namespace="{ns}", run="dash"'

        wanted = {f'trainium_run_restarts_by_kind{{{sel}, restart="inPlace"}}': 1,
                  f'trainium_run_restore_source{{{sel}, source="memory"}}': 1,
                  f'count(trainer_restore_seconds{{{sel}}})': 2,  # each pod's new workers said it
                  f'count(trainium_run_pod_node{{{sel}}})': 2}
        seen: dict = {}

        def restarted_and_scraped() -> bool:
            seen.update({expr: prom.value(expr) for expr in wanted})
            seen["step"] = prom.value(f'min(trainer_step{{{sel}}})')
            return all(seen[e] == v for e, v in wanted.items()) and (seen["step"] or 0) > FAULT_AT + 5
        try:
            d.wait(restarted_and_scraped, 180, "Prometheus to have scraped the restarted gang", interval=1.0)
        except AssertionError as exc:
            targets = [(t["labels"].get("job"), t["scrapeUrl"], t["health"], t["lastError"])
                       for t in prom.api("targets")["data"]["activeTargets"]]
            raise AssertionError(f"{exc}; Prometheus had {seen}; targets {targets}") from None
        at = time.time()
        print(f"\ndashboard at {at:.0f}, after an in-place restart:")
        failures = prom.empty_panels(ns, at=at)
        assert not failures, "\n".join(failures)
        # the Neuron row reached the run through its pods' nodes, by instance id
        joined = prom.query(f'max by (instance_id, node) (trainium_run_pod_node{{{sel}}})', at)["data"]["result"]
        assert {(r["metric"]["node"], r["metric"]["instance_id"]) for r in joined} == set(instances.items())
        # the trainers' series carry the run and pod labels the panels group by
        pods = prom.query(f'max by (pod) (trainer_mfu_ratio{{{sel}}})', at)["data"]["result"]
        assert {r["metric"]["pod"] for r in pods} == {p.metadata.name for p in d.pods()}
    finally:
        if prom:
            prom.stop()
        if neuron:
            neuron.close()
        if pod_targets:
            pod_targets.close()
        if d:  # (a long run: its gang stops here, before its nodes go)
            d.custom.delete_namespaced_custom_object(drill.GROUP, drill.VERSION, d.ns, drill.PLURAL, d.name)
            d.wait(lambda: not d.pods(), 60, "the run's pods to be gone")
        for node in nodes:
            core.delete_node(node)
