"""Control-plane outages (tier e2e, pods as real processes): kube-apiserver stopped for 15 s
mid-run, then etcd restarted. The trainer keeps training (its progress writes fail and resume,
bounded, no crash), the pods keep running, and the operator rides it out: no restart of the
healthy gang, no failure in the status, goodput within 2 points of the trainer's own clock."""

from __future__ import annotations

import json
import time

import pytest

from localcluster import drill, faults
from localcluster.drill import Drill

from .test_faults import spec_for

pytestmark = pytest.mark.e2e

API_DOWN_SECONDS = 15  # longer than the hang timeout floor below
STEPS = 150  # still training when etcd restarts (asserted), ended soon after


def test_apiserver_down_and_etcd_restart_are_ridden_out(e2e, tiny_data, tmp_path):
    ns = e2e.namespace("control-plane")
    body = spec_for("tiny", tiny_data, tmp_path)
    body["spec"]["training"]["steps"] = STEPS
    # a hang timeout shorter than the outage: only the operator's knowledge of the outage saves the gang
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "hangTimeoutFloorSeconds": 8}
    d = Drill(e2e.cluster, ns, body)
    d.create()
    d.wait_step(10, 240)
    before = d.trained_step()
    took = faults.apiserver_down(e2e.cluster, API_DOWN_SECONDS)
    during = d.trained_step()
    print(f"\napiserver down {API_DOWN_SECONDS}s (ready again after {took:.1f}s): the trainer went from step "
          f"{before} to {during} meanwhile")
    assert during > before + 10, "the trainer keeps training while the API server is away"
    d.wait(lambda: d.status().get("step", 0) >= during, 60, "progress to reach the status again")
    time.sleep(3)
    assert d.trained_step() < STEPS - 10, "the run must still be training when etcd restarts"
    took = faults.etcd_restart(e2e.cluster, 2)
    print(f"etcd restarted (API answering again after {took:.1f}s)")
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 400, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    assert st["attempt"] == 1 and not st.get("failures") and not st.get("restartCount"), \
        "a restart of the healthy gang: " + json.dumps(st.get("failures"))  # all of it, not pytest's abridged repr
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    assert sorted(truth.losses) == list(range(1, STEPS + 1)) and truth.executions == STEPS
    gp = st["goodput"]
    print(f"control plane outages: run Succeeded at attempt 1; goodput status {gp['effectiveRatio']:.3f} vs truth "
          f"{truth.ratio:.3f}")
    assert abs(gp["effectiveRatio"] - truth.ratio) <= 0.02
    # The controllers came back too: a new namespace gets its default ServiceAccount (kube-
    # controller-manager re-lists after the outage, with backoff), so later tests start on a
    # working control plane rather than racing its recovery.
    t0 = time.monotonic()
    drill.new_namespace(e2e.core, "e2e-after-outage", timeout=120)
    print(f"a new namespace was ready {time.monotonic() - t0:.1f}s after the run ended")
