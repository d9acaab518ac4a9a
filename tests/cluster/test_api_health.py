"""The operator's API probe and the trainer's progress retry, against a real API server."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import wait_until
from trainer.contract.progress import ProgressReporter
from trainium_api import keys
from trainium_api import progress
from trainium_operator.apihealth import ApiHealth, ApiProbe
from trainium_operator.kube import Kube

pytestmark = pytest.mark.cluster


def _nothing_listening() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"https://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


def test_the_probe_sees_a_ready_api_server_and_a_refusing_address(local_cluster):
    from kubernetes import client
    api = local_cluster.api_client()
    Kube(api).ready(2.0)  # /readyz answers 200 through the operator's own credentials
    health = ApiHealth()
    probe = ApiProbe(Kube(api).ready, health, interval=0.1).start()
    time.sleep(0.5)
    probe.stop()
    assert health.outage(time.time()) is None

    gone = ApiHealth()
    refused = Kube(client.ApiClient(client.Configuration(host=_nothing_listening())))
    probe = ApiProbe(refused.ready, gone, interval=0.1).start()
    t0 = time.time()
    wait_until(lambda: gone.outage(time.time()) is not None, 10, what="the probe to see the refusal")
    probe.stop()
    began, ended = gone.outage(time.time())
    assert t0 - 1 <= began <= ended  # under way: it lasts until now


def test_a_failed_progress_report_is_sent_again_without_a_new_step(local_cluster, core_api, namespace, monkeypatch):
    """The pod does not exist at the first report (the patch fails, as it does while the API is
    away); once it does, the same report reaches it with no further report() call."""
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reporter = ProgressReporter(0.2, pod="rank0", namespace=namespace)
    try:
        reporter.report(progress.ProgressReport(step=7, tokens_per_second=100.0, loss=2.5))
        wait_until(lambda: reporter._retry_at > 0, 10, what="the first report to fail")
        assert reporter.sent == 0
        core_api.create_namespaced_pod(namespace, {"metadata": {"name": "rank0"}, "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "none"},  # never scheduled: only its annotation matters
            "containers": [{"name": "trainer", "image": "trainer:test"}]}})

        def annotated():
            ann = core_api.read_namespaced_pod("rank0", namespace).metadata.annotations or {}
            return progress.parse(ann.get(keys.PROGRESS))
        data, waited = wait_until(annotated, 15, what="the retried report")
        assert data.step == 7 and reporter.sent == 1
    finally:
        reporter.close()
