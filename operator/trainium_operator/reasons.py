"""Every event reason and condition the operator writes on a run, by name, and the one rule for
"a condition, and an event when it flips". Pure.

An event's reason and a condition's type and reason are what people and alerts filter on: they
are written here once, and the pass's modules name them (``Reason.RESTARTING``), never spell them.
"""

from __future__ import annotations

from typing import Literal, Protocol

from trainium_api.status import Condition, TrainingRunStatus


class Reason:
    """Event reasons (Kubernetes Events on the run)."""
    # the spec
    INVALID_SPEC = "InvalidSpec"
    INVALID_EDIT = "InvalidEdit"
    CREATE_FAILED = "CreateFailed"
    # the attempt's life
    STARTING = "Starting"
    PREFLIGHT = "Preflight"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    RESTARTING = "Restarting"
    RESTARTED = "Restarted"
    RECOVERED = "Recovered"
    IN_PLACE_GIVEN_UP = "InPlaceRestartGivenUp"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    # Kueue's admission (queueing)
    QUEUED = "Queued"
    ADMITTED = "Admitted"
    EVICTED = "Evicted"
    PREEMPTED = "Preempted"
    POLICY_REFUSED = "PodsRefused"
    # the pods
    POD_NOT_STARTING = "PodNotStarting"
    MALFORMED_PROGRESS = "MalformedProgress"
    STRAGGLER = "Straggler"
    SPARE_LOST = "SpareLost"
    SPARE_REPLACED = "SpareReplaced"
    SPARES_REFUSED = "SparesRefused"
    # the nodes
    NODE_QUARANTINED = "NodeQuarantined"
    NODE_QUARANTINE_SKIPPED = "NodeQuarantineSkipped"
    QUARANTINE_ENDED = "QuarantineEnded"
    NODE_GONE = "NodeGone"
    NODE_AVOIDED = "NodeAvoided"
    LATE_CULPRIT_KEPT = "LateCulpritKept"
    DISRUPTION = "Disruption"
    DISRUPTION_ENDED = "DisruptionEnded"
    # the checkpoint store (as the pods report it: store)
    SAVES_FAILING = "CheckpointSavesFailing"
    SAVES_RECOVERED = "CheckpointSavesRecovered"
    STORE_UNREADABLE = "CheckpointStoreUnreadable"
    STORE_READABLE = "CheckpointStoreReadable"
    CHECKPOINT_SKIPPED = "CheckpointSkipped"


class Cond:
    """Condition types (trainium_api.status.ConditionType)."""
    VALID = "Valid"
    FAILED = "Failed"
    DISRUPTED = "Disrupted"
    CHILDREN_CREATED = "ChildrenCreated"
    PODS_STARTED = "PodsStarted"
    PROGRESS_VALID = "ProgressValid"
    CHECKPOINTS_SAVING = "CheckpointsSaving"
    STORE_READABLE = "CheckpointStoreReadable"


class CondReason:
    """Condition reasons (PodsStarted=False takes the kubelet's own: observe.waiting_reason)."""
    SPEC_VALID = "SpecValid"
    INVALID_SPEC = "InvalidSpec"
    INVALID_EDIT = "InvalidEdit"
    FAILURE_POLICY = "FailurePolicy"
    CREATE_FAILED = "CreateFailed"
    CREATED = "Created"
    MASS_DISRUPTION = "MassNodeDisruption"
    NODES_RETURNED = "NodesReturned"
    STARTED = "Started"
    MALFORMED_PROGRESS = "MalformedProgress"
    PARSED = "Parsed"
    SAVES_FAILING = "SavesFailing"
    SAVE_COMPLETED = "SaveCompleted"
    STORE_UNREADABLE = "StoreUnreadable"
    LISTED = "Listed"


class Reporting(Protocol):
    """What :func:`report` needs of a pass (run_pass.Pass)."""
    old: TrainingRunStatus

    def condition(self, ctype: str, ok: bool, reason: str, message: str) -> None: ...

    def event(self, reason: str, message: str, warning: bool = False) -> None: ...


When = Literal["flip", "change", "always"]


def was(p: Reporting, ctype: str) -> Condition | None:
    """The condition of type ``ctype`` as the pass read it."""
    return next((c for c in p.old.conditions if c.type == ctype), None)


def report(p: Reporting, ctype: str, ok: bool, reason: str, message: str, event: str = "",
           said: str | None = None, warning: bool | None = None, when: When = "flip") -> None:
    """Set condition ``ctype`` and send ``event`` (its message ``said``, else the condition's;
    a warning when the condition is not ok, unless ``warning`` says) when:
      flip    its status flips (a first condition only when it is not ok): not at every
              failed save, nor at each ErrImagePull <-> ImagePullBackOff
      change  its status flips or its message changes (a new field found malformed)
      always  the caller found the edge itself (a disruption begins or ends)"""
    before = was(p, ctype)
    p.condition(ctype, ok, reason, message)
    if not event:
        return
    state = "True" if ok else "False"
    if when == "flip":
        send = (before is None and not ok) or (before is not None and before.status != state)
    elif when == "change":
        send = before is None or before.status != state or before.message != message
    else:
        send = True
    if send:
        p.event(event, message if said is None else said, warning=not ok if warning is None else warning)
