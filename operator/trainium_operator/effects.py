"""What a reconcile pass asks the applier to do, typed: one class per kind of effect.

The applier (applier.apply) matches on the class; ``kind`` names it in logs and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from trainium_api.agent import Order
from trainium_api.gangorder import GangOrder
from trainium_api.status import FailureRecord


@dataclass(frozen=True)
class Ensure:
    """Create ``obj`` unless it exists (a pod, or a child of the run: Service, ConfigMap, RBAC,
    the admission policy)."""
    obj: dict
    kind: ClassVar[str] = "ensure"


@dataclass(frozen=True)
class DeletePod:
    name: str
    grace: int
    kind: ClassVar[str] = "delete_pod"


@dataclass(frozen=True)
class OrderPod:
    """Write ``order`` on pod ``name`` for its agent (an in-place restart: trainium_api.agent), for
    an agent that does not read the gang order (OrderGang); None: only the labels."""
    name: str
    order: Order | None
    labels: tuple[tuple[str, str | None], ...] = ()
    """Labels to set with it (None removes one): a spare taking an index is labelled as the gang's pod."""
    kind: ClassVar[str] = "order_pod"


@dataclass(frozen=True)
class OrderGang:
    """Write ``order`` in the run's gang order object, which every agent of the gang watches
    (trainium_api.gangorder): one write for the whole gang."""
    order: GangOrder
    kind: ClassVar[str] = "order_gang"


@dataclass(frozen=True)
class Quarantine:
    """Taint and label node ``name``; with ``uid``, only while that Node object holds the name
    (another machine may have registered under it since: EKS names nodes by private IP)."""
    name: str
    reason: str
    uid: str = ""
    kind: ClassVar[str] = "quarantine"


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the run."""
    reason: str
    message: str
    warning: bool = False
    kind: ClassVar[str] = "event"


@dataclass(frozen=True)
class ObserveFailure:
    """The latency histograms observe a new failure (detection): once per record, since the
    status that recorded it was written before."""
    failure: FailureRecord
    kind: ClassVar[str] = "observe_failure"


@dataclass(frozen=True)
class ObserveRecovery:
    """... or its recovery."""
    failure: FailureRecord
    kind: ClassVar[str] = "observe_recovery"


@dataclass(frozen=True)
class PatchWorkload:
    """A JSON merge patch of the run's Kueue Workload ``name`` (workload.py builds ``patch``); of
    its status subresource with ``status``. One that carries a resourceVersion is refused once
    the Workload changed (the next pass patches again, from a fresh read)."""
    name: str
    patch: dict
    status: bool = True
    kind: ClassVar[str] = "patch_workload"


@dataclass(frozen=True)
class PrunePreflightLists:
    """Delete the run's ConfigMaps of pre-flight lists (plan.preflight_map) but ``keep`` (those a
    pod of the run mounts, and the one this pass makes), once older than
    applier.PREFLIGHT_LIST_MIN_AGE (a pod created since but not yet seen mounts one too)."""
    keep: frozenset[str]
    kind: ClassVar[str] = "prune_preflight_lists"


Effect = Union[Ensure, DeletePod, OrderPod, OrderGang, Quarantine, Event, ObserveFailure, ObserveRecovery, PatchWorkload,
               PrunePreflightLists]
