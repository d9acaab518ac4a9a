"""What one reconcile pass sees and decides (:class:`Pass`), and the rules every policy module
shares about the run's pods: which are the gang's, when a node is lost or dead, and the one rule
for stopping pods (graceful first, forced once the graceful delete has run out). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property

from trainium_api.fields import ConfigError
from trainium_api.gangorder import GangOrder
from trainium_api.spec import TrainingRunSpec
from trainium_api.status import CheckpointRef, Condition, FailureRecord, TrainingRunStatus

from . import inplace, plan
from .disruption_guard import DisruptionGuard
from .effects import DeletePod, Effect, Event
from .hostaccess import HostAccess
from .observe import NodeView, PodView
from .workload import FlavorView, WorkloadView


NEWER_ATTEMPT_GRACE_SECONDS = 60.0
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
"""Kubernetes' word that a node is shut down (non-graceful node shutdown): its pods may go at once."""


@dataclass
class Pass:
    """What one pass sees (the run, its pods and nodes, the status as read: ``old``) and what it
    decides (``new``: the status to write, and the effects)."""
    run: dict
    spec: TrainingRunSpec
    old: TrainingRunStatus
    new: TrainingRunStatus
    pods: list[PodView]
    nodes: dict[str, NodeView]
    now: float
    checkpoint: CheckpointRef | None
    disruption: str
    guard: DisruptionGuard
    api_outage: tuple[float, float] | None
    refused: ConfigError | None = None
    """An edit of the live run the operator's rules refuse: it goes on with the spec in force."""
    children_error: str = ""
    """Why the applier could not create a child or a pod in the last pass ("" when it could)."""
    children_error_since: float | None = None
    """Since when creates have been refused without a break."""
    effects: list[Effect] = field(default_factory=list)
    host: HostAccess = HostAccess()
    spares: list[PodView] = field(default_factory=list)
    """Standby pods (faultTolerance.spares) that have not taken an index: not the gang's."""
    workload: WorkloadView | None = None
    """The run's Kueue Workload as last seen (queueing.py; None: none, or not the run's)."""
    flavors: dict[str, FlavorView] = field(default_factory=dict)
    """Kueue's ResourceFlavors by name, as last seen."""
    mass_event: bool = False
    """``disruption`` is a mass event's (mass_events), not nodes lost together."""
    gang_order: GangOrder | None = None
    """The run's gang order as last seen (trainium_api.gangorder; None: none yet)."""
    departed: tuple[PodView, ...] = ()
    """The last view of the run's pods gone lately (Snapshot.departed)."""

    @property
    def name(self) -> str:
        return self.run["metadata"]["name"]

    @cached_property
    def gang_names(self) -> list[str]:
        return inplace.gang_names(self.old, self.name, self.spec.nodes)

    @cached_property
    def gone(self) -> list[PodView]:
        """The last view of the gang's pods already gone, seen on their way out (departed: the
        snapshot keeps only pods no longer present)."""
        names = set(self.gang_names)
        return [p for p in self.departed if p.name in names]

    @cached_property  # its inputs (pods, old) do not change during a pass; asked often
    def gang(self) -> list[PodView]:
        """The pods the attempt in force runs in, as they are (an in-place restart keeps the
        pods of an earlier attempt, a replaced index runs in its replacement: inplace.gang_names)."""
        names = set(self.gang_names)
        return [p for p in self.pods if p.name in names]

    @cached_property
    def replacement(self) -> list[PodView]:
        """The pod taking the index being replaced (restart replace), while Restarting: a
        spare, or a new pod under the next attempt's name; it waits at the barrier."""
        name, index = self.old.current.replacement, self.old.current.replacing
        # a spare by name, or the index's pod of the next attempt: never another pod of the gang
        # (a status edited to name one)
        return [p for p in self.pods + self.spares if name and index is not None and p.name == name and (
            plan.is_spare_name(self.name, p.name) or (p.index == index and p.attempt == self.old.attempt + 1))]

    @cached_property
    def current(self) -> list[PodView]:
        """The gang as the attempt in force sees it: its agents' reports on this attempt's
        workers (inplace.as_of)."""
        return inplace.as_of(self.gang, self.old.attempt, self.old.current.start_time, self.now)

    @cached_property
    def stale(self) -> list[PodView]:
        """Pods of other attempts. One of a newer attempt than the status read means this pass
        read the status before the write that started that attempt reached the watch: it is
        not stale unless it has lived for NEWER_ATTEMPT_GRACE_SECONDS (a status reset by hand).
        (Pods are told apart by name: comparing whole views was most of a 128-pod pass.)"""
        kept = {p.name for p in self.gang + self.replacement}
        return [p for p in self.pods if p.name not in kept and (p.attempt <= self.old.attempt or (
            self.now - (p.created or self.now) > NEWER_ATTEMPT_GRACE_SECONDS))]

    @property
    def newer(self) -> list[PodView]:
        left = {p.name for p in self.stale + self.replacement}
        return [p for p in self.pods if p.attempt > self.old.attempt and p.name not in left]

    @property
    def grace(self) -> int:
        return int(self.spec.fault_tolerance.teardown_grace_seconds)

    @property
    def last_failure(self) -> FailureRecord | None:
        """The newest failure on the status this pass writes (the one being restarted from)."""
        return self.new.failures[-1] if self.new.failures else None

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.effects.append(Event(reason, message, warning))

    def delete(self, pods: list[PodView], grace: int | None = None) -> None:
        self.effects += [DeletePod(p.name, self.grace if grace is None else grace)
                         for p in pods if not p.deleting]

    def condition(self, ctype: str, ok: bool, reason: str, message: str) -> None:
        """Set one condition, keeping the others."""
        new = condition(ctype, ok, reason, message, self.now, self.new.conditions)
        self.new.conditions = [c for c in self.new.conditions if c.type != ctype] + [new]


def condition(ctype: str, ok: bool, reason: str, message: str, now: float,
              previous: list[Condition] | None = None) -> Condition:
    """A status condition. ``lastTransitionTime`` moves only when the status flips: an earlier
    condition of the same type and status (from ``previous``) keeps its time."""
    state = "True" if ok else "False"
    kept = next((c.last_transition_time for c in previous or []
                 if c.type == ctype and c.status == state and c.last_transition_time), None)
    return Condition(type=ctype, status=state, reason=reason, message=message[:1000],
                     last_transition_time=kept or datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def node_gone(p: Pass, pod: PodView) -> bool:
    """Whether ``pod``'s node is known dead: its Node object deleted (the instance terminated),
    or tainted out-of-service. Only then is a failed pod forced at once: on a node that is only
    NotReady its processes may live on, and its replacement takes the same index."""
    node = p.nodes.get(pod.node) if pod.node else None
    return bool(pod.node) and (node is None or OUT_OF_SERVICE_TAINT in node.taints)


def node_lost(p: Pass, pod: PodView) -> bool:
    """Whether ``pod``'s node is gone, NotReady or unreachable."""
    node = p.nodes.get(pod.node) if pod.node else None
    return bool(pod.node) and (node is None or node.ready != "True")


def overdue(p: Pass, pod: PodView, since: float | None = None, dead: bool = False) -> bool:
    """The one rule for forcing a delete (grace 0): ``pod`` is being deleted and its graceful
    delete has run out (its deletionTimestamp passed; without one, the teardown grace since
    ``since``, when given), or, with ``dead``, its node is known dead (:func:`node_gone`). A pod
    on a node that no longer answers never finishes a graceful delete."""
    if not pod.deleting:
        return False
    if dead and node_gone(p, pod):
        return True
    if pod.gone_by is not None:
        return p.now >= pod.gone_by
    return since is not None and p.now - since >= p.spec.fault_tolerance.teardown_grace_seconds


def stop(p: Pass, pods: list[PodView], since: float, dead: bool = False) -> None:
    """Delete ``pods`` gracefully, and force one that is :func:`overdue`. A pod never sent a
    graceful delete (an operator away after the status write) gets one first: the trainer saves
    on it."""
    for pod in pods:
        if not pod.deleting:
            p.effects.append(DeletePod(pod.name, p.grace))
        elif overdue(p, pod, since, dead):
            p.effects.append(DeletePod(pod.name, 0))
