"""The mass-disruption guard: when many nodes look lost at once, hold quarantines and restarts
(operator-wide settings, python -m trainium_operator --disruption-*). Pure.

:class:`DisruptionGuard` is the operator's configuration; :func:`zone_health` and
:func:`disruption` are the finding the handlers make once per pass for every run; the judge
holds lost nodes and hangs while one lasts (judge._hold).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from trainium_api import keys

from .observe import NodeView


@dataclass(frozen=True)
class DisruptionGuard:
    """When many nodes look lost at once, the cause is almost never the nodes: the control
    plane, its network or the lease path blipped, and the kubelets and their pods are still
    running. Kubernetes' node lifecycle controller stops evicting in such a zone; we stop
    quarantining and restarting. Operator-wide (python -m trainium_operator --disruption-*)."""

    threshold: float = 0.55
    """Share of a zone's nodes (or of a run's nodes) NotReady/Unknown at which it counts as
    disrupted (the node lifecycle controller's --unhealthy-zone-threshold)."""
    min_nodes: int = 3
    """...and at least this many of them: one or two lost nodes are node failures."""
    max_hold_seconds: float = 900.0
    """A run holds its restart at most this long; then a lost node is handled as lost."""
    settle_seconds: float = 10.0
    """A node Unknown (its heartbeats stopped) for less than this is not yet a failure: the
    nodes of one disruption go Unknown within about one heartbeat interval of each other, and
    acting on the first would quarantine it and restart before the disruption shows. A node
    whose kubelet reports NotReady is acted on at once."""
    outage_grace_seconds: float = 60.0
    """After the operator lost the API server, a node that goes Unknown up to this long after the
    API is back is the outage's: its kubelet could not renew its lease meanwhile, and the node
    controller marks it only after its own grace period (40-50 s by default). Held, at most
    max_hold_seconds, until it is Ready again."""
    outage_min_seconds: float = 10.0
    """...if the outage lasted at least this long. A shorter one cannot make a lease lapse (the
    kubelet renews every 10 s against a 40-50 s grace period), and the API probe sees blips of
    a few seconds on a busy operator: those must not hold a node that is really lost."""

    mass_threshold: float = 0.2
    """Share of the cluster's nodes that turned NotReady, or of its Neuron nodes that lost
    Neuron devices, within mass_window_seconds (and at least min_nodes of them) at which it
    counts as a mass event: a device-plugin rollout or a container runtime restart across the
    fleet, not a fault of each node (mass_events). Lower than threshold: such a rollout takes
    nodes a batch at a time, and nodes recovered within the window still count."""
    mass_window_seconds: float = 120.0
    """How far back a node's turn to NotReady or to missing Neuron devices counts for a mass
    event. A node bad for longer (broken, awaiting repair) does not: it turned bad long ago."""

    device_settle_seconds: float = 30.0
    """Allocatable Neuron devices below capacity for less than this is not yet a device
    failure: the Neuron device plugin restarting (an upgrade, a crash) unregisters the devices
    and registers them again within seconds; a device really lost stays missing."""

    trust_pod_reports: bool = False
    """Quarantine (taint, for every run) a node that only a run's own pods named as faulty: the
    Neuron runtime's words in a termination message, a straggler report. Off by default: those
    are written by the run author's code, so such a node is only avoided by that run
    (status.avoidedNodes). Turn on where every run's image is trusted."""
    culprit_wait_seconds: float = 5.0
    """When every pod that failed so far only lost a peer (the Neuron runtime said so: a
    collective that never completed, a closed connection) while others still run, wait this long
    for the pod that caused it to fail and name its node: the rank with the hardware fault may
    still be timing out in the runtime. Then the first failed pod is blamed as before."""

    def validate(self) -> None:
        for name in ("threshold", "mass_threshold"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"disruption {name.replace('_', ' ')} must be in (0, 1], got {getattr(self, name)}")
        if self.min_nodes < 1 or min(self.max_hold_seconds, self.settle_seconds, self.outage_grace_seconds,
                                         self.outage_min_seconds, self.device_settle_seconds,
                                         self.culprit_wait_seconds, self.mass_window_seconds) < 0:
            raise ValueError("disruption min nodes must be at least 1, and its seconds not negative")


# Failures a disruption can fake: a node that looks lost, a gang whose progress cannot reach us.
DISRUPTION_CAUSES = ("node", "hang")


def zone_health(nodes: Iterable[NodeView]) -> dict[str, tuple[int, int]]:
    """zone -> (unhealthy nodes, nodes): Ready not True counts as unhealthy. Nodes the operator
    quarantined are left out: they are lost on purpose, and must not make a real failure look
    like a disruption."""
    total, bad = Counter(), Counter()
    for n in nodes:
        if keys.QUARANTINE_TAINT in n.taints:
            continue
        total[n.zone] += 1
        bad[n.zone] += n.ready != "True"
    return {z: (bad[z], total[z]) for z in total}


def disruption(guard: DisruptionGuard, zones: dict[str, tuple[int, int]], run_nodes: Iterable[NodeView]) -> str:
    """Why the run's nodes look lost through no fault of their own ("" when they do not): the
    zone of one of its unhealthy nodes is disrupted, or the run's own nodes are."""
    run_nodes = list(run_nodes)
    lost = [n for n in run_nodes if n.ready != "True"]
    if not lost:
        return ""
    for zone in sorted({n.zone for n in lost}):
        bad, total = zones.get(zone, (0, 0))
        if bad >= guard.min_nodes and bad >= guard.threshold * total:
            return f"{bad} of {total} nodes{f' in zone {zone}' if zone else ''} are NotReady or Unknown"
    if len(lost) >= guard.min_nodes and len(lost) >= guard.threshold * len(run_nodes):
        return f"{len(lost)} of the run's {len(run_nodes)} nodes are NotReady or Unknown"
    return ""
