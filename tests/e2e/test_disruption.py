"""A control-plane or network disruption is not a node failure (tier e2e, pods as real
processes): every node of the cluster drops out of the control plane's view at once (no status,
no lease: Unknown) while the kubelets and the trainer keep running. The operator must neither
quarantine nor restart; it says so (condition Disrupted, events), and handles failures normally
again when the nodes return. The run trains throughout."""

from __future__ import annotations

import contextlib
import time

import pytest

from localcluster import faults
from localcluster.drill import Drill

from .test_faults import spec_for

pytestmark = pytest.mark.e2e


def condition(st: dict, ctype: str) -> dict:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), {})


def test_most_nodes_lost_together_hold_the_run_which_keeps_training(e2e, tiny_data, tmp_path):
    ns = e2e.namespace("disruption")
    body = spec_for("tiny", tiny_data, tmp_path)
    body["spec"]["training"]["steps"] = 5000  # longer than the test: it is deleted at the end
    # a short hang timeout: a restart, had the operator taken the lost nodes for failures, comes fast
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "hangTimeoutFloorSeconds": 8}
    d = Drill(e2e.cluster, ns, body)
    d.create()
    d.wait_step(5, 240)
    drained = faults.partition_together(e2e.core, e2e.nodes)  # Ready until kwok's last heartbeat fired
    cut = time.time()
    st = d.wait(lambda: condition(s := d.status(), "Disrupted").get("status") == "True" and s, 90,
                "the operator to see a disruption")
    lost = [n.metadata.name for n in e2e.core.list_node().items
            if any(c.type == "Ready" and c.status != "True" for c in n.status.conditions or [])]
    assert sorted(lost) == sorted(e2e.nodes), lost
    print(f"\ndisruption: {len(lost)} of {len(e2e.nodes)} nodes Unknown +{time.time() - cut:.1f}s after "
          f"{drained:.0f}s of draining kwok's heartbeats; "
          f"{condition(st, 'Disrupted')['message']}")
    before = d.trained_step()
    time.sleep(10)  # nodes Unknown for 10 s more: past the hang timeout's floor (8 s)
    assert d.trained_step() > before + 5, "the trainer keeps training while its nodes look lost"
    for node in e2e.nodes:
        faults.node_recover(e2e.core, node)
    st = d.wait(lambda: condition(s := d.status(), "Disrupted").get("status") == "False" and s, 90,
                "the disruption to end")
    step = d.trained_step()
    d.wait_step(step + 5, 60)
    st = d.status()
    assert st["attempt"] == 1 and not st.get("failures") and not st.get("restartCount")
    assert not st.get("quarantinedNodes") and st["phase"] == "Running"
    assert not any(t.key == "trainium.dev/quarantined" for n in e2e.core.list_node().items for t in n.spec.taints or [])
    reasons = [e.reason for e in e2e.core.list_namespaced_event(ns).items]
    assert "Disruption" in reasons and "DisruptionEnded" in reasons and "Restarting" not in reasons
    print(f"disruption: ended +{time.time() - cut:.1f}s; run still attempt 1 at step {d.trained_step()}, no failure")
    d.custom.delete_namespaced_custom_object("trainium.dev", "v1alpha1", ns, "trainingruns", d.name)


def test_a_device_plugin_restart_on_every_node_at_once_is_held_not_quarantined(e2e, tiny_data, tmp_path):
    """A device-plugin rollout: every node's Neuron devices are unregistered at once, for longer
    than one node's shortfall may settle (guard.device_settle_seconds, 30 s), and then come back.
    Each node alone would be a device fault; all of them turning so within the mass-event window
    is a cluster-wide event (mass_events): the operator holds, quarantines nothing, spends no
    budget, and says so in status.disruption, while the trainer trains on (its pods' processes
    never used the devices: the e2e nodes are CPU nodes that the test gives 16 Neuron devices each,
    as the device plugin would register them)."""
    ns = e2e.namespace("device-plugin")
    for node in e2e.nodes:  # the device plugin registers 16 devices on each node
        devices = {faults.NEURON: "16", faults.NEURONCORE: "32"}
        e2e.core.patch_node_status(node, {"status": {"capacity": devices, "allocatable": devices}})
    try:
        body = spec_for("tiny", tiny_data, tmp_path)
        body["spec"]["training"]["steps"] = 5000  # longer than the test: it is deleted at the end
        d = Drill(e2e.cluster, ns, body)
        d.create()
        d.wait_step(5, 240)
        cut = time.time()
        for node in e2e.nodes:
            faults.device_loss(e2e.core, node, 0)
        st = d.wait(lambda: (s := d.status()).get("disruption") and s, 30, "the operator to name the mass event")
        print(f"\ndevice-plugin restart: held +{time.time() - cut:.1f}s: {st['disruption']['message']}")
        assert "missing Neuron devices" in st["disruption"]["message"], st["disruption"]
        before = d.trained_step()
        time.sleep(max(0.0, cut + 36 - time.time()))  # past one node's device settle time (30 s)
        st = d.status()
        assert st.get("disruption") and not st.get("failures") and st["attempt"] == 1, st
        for node in e2e.nodes:
            faults.device_restore(e2e.core, node)
        st = d.wait(lambda: not (s := d.status()).get("disruption") and s, 30, "the mass event to end")
        assert d.trained_step() > before, "the trainer keeps training through the rollout"
        assert not st.get("failures") and not st.get("restartCount") and st["attempt"] == 1, st
        assert not st.get("quarantinedNodes") and not st.get("avoidedNodes")
        assert not any(t.key == "trainium.dev/quarantined" for n in e2e.core.list_node().items
                       for t in n.spec.taints or [])
        reasons = [e.reason for e in e2e.core.list_namespaced_event(ns).items]
        assert "Disruption" in reasons and "DisruptionEnded" in reasons and "Restarting" not in reasons
        print(f"device-plugin restart: ended +{time.time() - cut:.1f}s; attempt 1 at step {d.trained_step()}, "
              "no failure, no quarantine")
    finally:  # the run (5000 steps) must not outlive the test: the next tests share its nodes
        with contextlib.suppress(Exception):
            d.custom.delete_namespaced_custom_object("trainium.dev", "v1alpha1", ns, "trainingruns", d.name)
        for node in e2e.nodes:  # as before: CPU nodes
            gone = {faults.NEURON: None, faults.NEURONCORE: None}
            e2e.core.patch_node_status(node, {"status": {"capacity": gone, "allocatable": gone}})
