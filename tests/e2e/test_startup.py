"""A pod placed on a node that can never start its container (issue 22): here a Secret the pod's
environment names does not exist, so the process-backed kubelet reports
CreateContainerConfigError, as a real kubelet does. Before, the startup clock began only once
the whole gang was Running, so such a pod held its gang's other nodes for good with nothing in
the run's status."""

from __future__ import annotations

import time

import pytest

from localcluster import drill
from localcluster.drill import Drill

pytestmark = pytest.mark.e2e
TIMEOUT = 6  # startupTimeoutSeconds


def test_a_pod_that_cannot_start_is_named_at_once_then_fails_the_run_on_its_budget(e2e, tiny_data, tmp_path):
    body = drill.manifest("nostart", tiny_data, tmp_path,
                          faultTolerance={"startupTimeoutSeconds": TIMEOUT, "restartBudget": {"startup": 1}})
    body["spec"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    d = Drill(e2e.cluster, e2e.namespace("nostart"), body)
    d.create()
    t0 = time.monotonic()

    def not_started():
        cond = next((c for c in d.status().get("conditions") or [] if c["type"] == "PodsStarted"), None)
        return cond if cond and cond["status"] == "False" else None
    cond = d.wait(not_started, 30, "PodsStarted=False")
    shown = time.monotonic() - t0
    print(f"\nshown in status {shown:.1f}s after creation: {cond['reason']}: {cond['message']}")
    assert cond["reason"] == "CreateContainerConfigError" and "hf-token" in cond["message"]
    assert d.status()["phase"] == "Starting" and "hf-token" in d.status()["message"]

    st = d.wait(lambda: (s := d.status()).get("phase") in ("Failed", "Succeeded") and s, 60, "the run to end")
    took = time.monotonic() - t0
    print(f"Failed {took:.1f}s after creation: {st['message']}")
    assert st["phase"] == "Failed" and "restart budget for startup exhausted" in st["message"]
    assert "CreateContainerConfigError" in st["message"] and "hf-token" in st["message"]
    causes = [f["cause"] for f in st["failures"]]
    assert causes == ["startup", "startup"] and st["restarts"] == {"startup": 1}
    assert not [p for p in d.pods() if not p.metadata.deletion_timestamp and p.status.phase == "Running"]
