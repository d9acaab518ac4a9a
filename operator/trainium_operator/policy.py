"""Failure + history -> action. Pure.

Actions: restart the gang (after a backoff), optionally quarantining the node that failed;
or fail the run with a reason. Never a loop: every restart spends a per-cause budget within a
time window, a bounded number of nodes can be quarantined, and K restarts in a row for causes
the job may be behind (application, hang) without the checkpoint step advancing end the run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from trainium_api import keys
from trainium_api.spec import JOB_CAUSES, TrainingRunSpec
from trainium_api.status import MAX_RECENT_KEPT, FailureAction, FailureCounters, FailureRecord

from .observe import Failure, NodeView


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
        if not 0 < self.threshold <= 1:
            raise ValueError(f"disruption threshold must be in (0, 1], got {self.threshold}")
        if self.min_nodes < 1 or min(self.max_hold_seconds, self.settle_seconds, self.outage_grace_seconds,
                                         self.outage_min_seconds, self.device_settle_seconds,
                                         self.culprit_wait_seconds) < 0:
            raise ValueError("disruption min nodes must be at least 1, and its seconds not negative")


# Failures whose node is quarantined (faultTolerance.quarantine): the node is the fault.
QUARANTINE_CAUSES = ("node", "neuron-device", "straggler", "preflight")
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


@dataclass
class Action:
    kind: FailureAction
    reason: str
    quarantine_node: str = ""
    delay_seconds: float = 0.0
    avoid_node: str = ""
    """Keep this run's pods off the node, without a taint (the evidence is the run's own)."""


def count(counters: FailureCounters, cause: str, time: float, checkpoint_step: int | None,
          window_seconds: float) -> FailureCounters:
    """The counters with one more failure of ``cause`` detected at ``time`` (a new object)."""
    recent = {c: [t for t in ts if time - t <= window_seconds] for c, ts in counters.recent.items()}
    # a cause whose times all left the window keeps its (empty) list: the status is written as
    # a merge patch, which replaces lists whole but would keep a key that is left out
    recent[cause] = (recent.get(cause, []) + [time])[-MAX_RECENT_KEPT:]
    streak, at = counters.streak, counters.streak_checkpoint_step
    if cause in JOB_CAUSES:  # an infrastructure failure says nothing about the job making progress
        streak, at = (streak + 1, at) if streak and at == checkpoint_step else (1, checkpoint_step)
    return FailureCounters(recent=recent, streak=streak, streak_checkpoint_step=at)


def counters_from(history: list[FailureRecord], window_seconds: float) -> FailureCounters:
    """Counters from the kept failure records (a status written before the counters existed)."""
    counters = FailureCounters()
    for h in history:
        counters = count(counters, h.cause, h.time, h.checkpoint_step, window_seconds)
    return counters


def excluded_node(node: str, cause: str, pod_reported: bool, trust_pod_reports: bool) -> tuple[str, str]:
    """(node to quarantine, node to avoid) for a failure of ``cause`` on ``node``."""
    if not node or cause not in QUARANTINE_CAUSES:
        return "", ""
    return ("", node) if pod_reported and not trust_pod_reports else (node, "")


def straggler_replace_allowed(spec: TrainingRunSpec, counters: FailureCounters, excluded: list[str],
                              now: float) -> bool:
    """Whether a straggler may restart the gang: only when its node can be left out and the
    straggler budget has room. A slow node is not worth failing the run for: otherwise it is
    only reported."""
    ft = spec.fault_tolerance
    window = ft.budget_window_minutes * 60
    spent = len([t for t in counters.recent.get("straggler", []) if now - t <= window])
    return ft.quarantine and len(excluded) + 1 <= spec.quarantine_limit() and spent < ft.restart_budget.straggler


def decide(failure: Failure, spec: TrainingRunSpec, counters: FailureCounters, quarantined: list[str],
           checkpoint_step: int | None, now: float, avoided: list[str] = (), trust_pod_reports: bool = False) -> Action:
    """``counters``: the run's earlier failures, counted (status.failureCounters);
    ``quarantined``, ``avoided``: nodes this run already keeps out (tainted, or only avoided)."""
    ft = spec.fault_tolerance
    if failure.fatal:
        return Action("fail", f"fatal error, not retried: {failure.message}")
    window = ft.budget_window_minutes * 60
    recent = {c: [t for t in ts if now - t <= window] for c, ts in counters.recent.items()}
    same_cause = len(recent.get(failure.cause, []))
    budget = ft.restart_budget.for_cause(failure.cause)
    if same_cause >= budget:
        return Action("fail", f"restart budget for {failure.cause} exhausted ({same_cause} restarts in "
                      f"{ft.budget_window_minutes:g} min): {failure.message}")
    # consecutive job-caused restarts without the checkpoint step advancing
    streak = counters.streak if counters.streak_checkpoint_step == checkpoint_step else 0
    if failure.cause in JOB_CAUSES and streak >= ft.no_progress_restarts:
        return Action("fail", f"no progress: {streak} restarts without the checkpoint step advancing "
                      f"(last checkpoint {checkpoint_step}): {failure.message}")
    node, avoid = "", ""
    excluded = [*quarantined, *(n for n in avoided if n not in quarantined)]
    if ft.quarantine and failure.node and failure.cause in QUARANTINE_CAUSES and failure.node not in excluded:
        if len(excluded) + 1 > spec.quarantine_limit():
            return Action("fail", f"cluster unhealthy: leaving out {failure.node} would exceed "
                          f"{spec.quarantine_limit()} quarantined or avoided nodes ({', '.join(excluded)})")
        node, avoid = excluded_node(failure.node, failure.cause, failure.pod_reported, trust_pod_reports)
    failures_in_window = sum(len(ts) for ts in recent.values())
    delay = min(ft.max_backoff_seconds, ft.backoff_seconds * (2 ** min(failures_in_window, 30))) \
        if ft.backoff_seconds else 0.0
    return Action("restart", failure.message, quarantine_node=node, delay_seconds=delay, avoid_node=avoid)
