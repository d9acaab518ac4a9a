"""The TrainingRun status: everything the operator remembers about a run, typed.

The status is the operator's only memory (an operator killed and started again continues from
it), so every field is declared here once; the reconcile pass reads it into these classes and
writes back the fields it changed. Times are epoch seconds; the trainer's own step end times
where named "progress".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from .checkpoints import RESTORE_SOURCES
from .spec import Cause

Phase = Literal["Queued", "Starting", "Preflight", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
"""Queued: Kueue holds the run (metadata.labels kueue.x-k8s.io/queue-name): not admitted yet, or
evicted or preempted and waiting to be admitted again (status.queue says which, and why)."""
PHASES: tuple[str, ...] = get_args(Phase)
TERMINAL: tuple[str, ...] = ("Succeeded", "Failed")
HELD: tuple[str, ...] = ("Suspended", "Queued")
"""No gang runs by decision (the user's spec.suspend, or Kueue's): time held leaves goodput's wall time."""
QueueState = Literal["Queued", "Admitted", "Evicted", "Preempted", "Finished"]
ConditionStatus = Literal["True", "False", "Unknown"]
FailureAction = Literal["restart", "fail"]
RestartKind = Literal["inPlace", "replace", "recreate"]
"""inPlace: the gang's pods stayed and their agents started new workers; replace: the failed
pod alone was replaced by a new one, the others restarted in place; recreate: new pods."""
RESTART_KINDS: tuple[str, ...] = get_args(RestartKind)
RestoreSource = Literal[RESTORE_SOURCES]  # type: ignore[valid-type]  # one source: checkpoints
ConditionType = Literal["Valid", "Failed", "Disrupted", "ChildrenCreated", "PodsStarted", "ProgressValid",
                        "CheckpointsSaving", "CheckpointStoreReadable"]
"""Valid: the spec passed the operator's checks. Failed: the failure policy gave up.
Disrupted: a mass node disruption holds failures. ChildrenCreated: the attempt's Service,
ConfigMap and trainer RBAC exist (False: why a create failed; retried every pass). PodsStarted:
every pod of the attempt placed on a node has started its container (False: which pod waits,
and the kubelet's reason, e.g. ImagePullBackOff or CreateContainerConfigError). ProgressValid:
the pods' progress annotations parse (False: which pod wrote which field wrong; that field is
dropped, the rest of the report is used). CheckpointsSaving: the pods' saves complete (False: a pod
reports saves failing since its last complete one, with the newest error; it clears when one
completes). CheckpointStoreReadable: the pods can list their checkpoint store (False: the error a
pod reports; the operator never lists the store itself)."""


class _Written:
    """Written by the operator only: the API server fills in no defaults."""
    SERVER_DEFAULTS: ClassVar[bool] = False


@dataclass
class Condition(_Written):
    type: ConditionType
    """Valid, Failed, Disrupted, ChildrenCreated, PodsStarted, ProgressValid, CheckpointsSaving or
    CheckpointStoreReadable (see ConditionType)."""
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    """When status last flipped (RFC 3339); unchanged while it keeps its status."""


@dataclass
class CheckpointRef(_Written):
    """A complete checkpoint in the run's store, as the run's pods report it (the operator does
    not read the store: it runs without the pods' volumes and credentials)."""
    tag: str = ""
    step: int | None = None
    time: float | None = None
    """When its completion marker was written."""
    uri: str = ""


@dataclass
class Disruption(_Written):
    since: float
    message: str = ""
    mass: bool | None = None
    """True: a mass event (many nodes turned NotReady or lost their Neuron devices: mass_events), which
    holds only those signals and hangs; else a disruption (nodes lost together), which holds
    every lost node."""


@dataclass
class LostSeconds(_Written):
    """Seconds lost to failures, by phase (see goodput)."""
    detect: float = 0.0
    """Last step of the failed attempt -> detection."""
    teardown: float = 0.0
    """Detection -> every pod of the attempt gone."""
    schedule: float = 0.0
    """Teardown done (or creation) -> the new attempt trains again."""
    recompute: float = 0.0
    """Steps trained after the checkpoint resumed from, trained again."""
    preflight: float = 0.0
    """The pre-flight check (faultTolerance.preflight): each attempt's, and attempts that failed it."""
    restore: float = 0.0
    """Reading the checkpoint an attempt resumed from, and loading it into the model and optimizer."""


@dataclass
class RestartLosses(_Written):
    """Of the seconds lost to failures, those of the failures restarted each way
    (failures[].restart), by phase: detect, teardown, schedule (here including the new
    attempt's pre-flight check and restore: preflight and restore stay 0 in this breakdown) and
    recompute."""
    in_place: LostSeconds = field(default_factory=LostSeconds)
    replace: LostSeconds = field(default_factory=LostSeconds)
    recreate: LostSeconds = field(default_factory=LostSeconds)


@dataclass
class Goodput(_Written):
    wall_seconds: float = 0.0
    productive_seconds: float = 0.0
    lost_seconds: LostSeconds = field(default_factory=LostSeconds)
    effective_ratio: float | None = None
    """productiveSeconds / wallSeconds."""
    by_restart: RestartLosses = field(default_factory=RestartLosses)
    """The failures' lost seconds by how each was restarted (in place, pod replaced, gang recreated)."""


@dataclass
class GoodputArchive(_Written):
    """Running totals of failures no longer kept in status.failures, so their lost time never
    turns into productive time."""
    lost_seconds: LostSeconds = field(default_factory=LostSeconds)
    until: float = 0.0
    """Where the archived part of the timeline ends."""
    failures: int = 0
    """Failures folded in."""
    by_restart: RestartLosses = field(default_factory=RestartLosses)


@dataclass
class FailureRecord(_Written):
    """One failure and the restart that followed, as its phases completed."""
    id: int
    """1, 2, ... over the run: the failure's identity (metrics observe each once)."""
    time: float
    """Detection."""
    cause: Cause = "application"
    """What failed (a restart budget each)."""
    action: FailureAction = "restart"
    node: str | None = None
    pod: str | None = None
    message: str = ""
    attempt: int | None = None
    detected_after: float | None = None
    """Seconds from the failure's first sign to detection."""
    last_progress_time: float | None = None
    """The failed attempt's newest step end (kept current while a stopped gang finishes its step)."""
    step: int | None = None
    """The failed attempt's newest step."""
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    """When the failed attempt's step ``checkpoint_step`` ended, where its trainer said so
    (progress ``lastCheckpointTime``): the recompute phase is then the time from it to
    ``last_progress_time``, not the steps between them times ``step_seconds``."""
    step_seconds: float | None = None
    teardown_done_time: float | None = None
    recovered_time: float | None = None
    """The new gang all Running."""
    recovered_after: float | None = None
    resumed_time: float | None = None
    """A step end of the new attempt's first progress report: its first step's where the trainer
    reports it (progress ``firstStepTime``), else the newest step's."""
    resumed_step: int | None = None
    """The checkpoint step the new attempt resumed from."""
    resumed_steps: int | None = None
    """Steps the new attempt had trained at its first report."""
    restart: RestartKind | None = None
    """How the gang was restarted (recreate also when an in-place restart was given up)."""
    runtime_status: str | None = None
    """The Neuron runtime's status the failed pod reported (NRT_..., trainium_api.runtimefaults)."""
    exempt: Literal["capacity", "voluntary"] | None = None
    """Why the restart spent no budget (None: it did): capacity, the gang was not placed whole;
    voluntary, the cluster moved it on purpose (a drain, an eviction through the API, a
    preemption by the scheduler)."""


@dataclass
class QuarantinedMachine(_Written):
    """The machine behind a node this run quarantined (status.quarantinedMachines). A Node object
    deleted and registered again under its name (a kubelet after `kubectl delete node`) comes
    back without the taint: the same machine (its providerID) is quarantined again; another
    machine reusing the name (EKS names nodes by private IP) is not."""
    node: str = ""
    uid: str = ""
    """The Node object's metadata.uid when it was quarantined: another uid is a new object."""
    provider_id: str = ""
    """spec.providerID (aws:///<zone>/<instance-id>): the machine. Empty: none was given, and a
    node registered again is not quarantined (nothing says it is the same machine)."""
    since: float | None = None
    """When it was quarantined (again, after it registered again): the taint is ordered until
    seen, for QUARANTINE_RETRY_SECONDS from then."""
    gone_time: float | None = None
    """Since when the Node object is gone: the machine is remembered for
    QUARANTINE_REMEMBER_SECONDS, then forgotten."""
    undecided_since: float | None = None
    """Since when a Node object registered again under the name has had no providerID to tell
    whether it is this machine: decided within QUARANTINE_RETRY_SECONDS, else the quarantine ends."""


@dataclass
class NodeRepair(_Written):
    """A node the run left out that EKS node auto repair is to replace (status.nodeRepairs): a
    condition it acts on is bad (trainium_api.nodesignals). The run does not wait for it: it
    trains elsewhere, and the new node is another machine (another providerID)."""
    node: str = ""
    condition: str = ""
    """The condition auto repair acts on (AcceleratedHardwareReady, NetworkingReady, ..., Ready)."""
    reason: str = ""
    since: float | None = None
    """When the condition turned bad."""
    repair_after: float | None = None
    """When auto repair acts at the earliest (since + its wait: 10 minutes for
    AcceleratedHardwareReady, 30 for the others and Ready), where it is enabled."""


@dataclass
class AvoidedNode(_Written):
    """A node the run keeps its pods off on its own pods' word (status.avoidedNodes)."""
    node: str = ""
    time: float = 0.0
    """Since when: the run tries it again budgetWindowMinutes later."""
    reason: str = ""


@dataclass
class PreflightPass(_Written):
    """A node that passed this run's pre-flight check (status.preflightPassed)."""
    node: str = ""
    time: float = 0.0
    """When the attempt it passed with first reported progress."""


@dataclass
class StragglerStreak(_Written):
    """One pod's run of progress reports whose compute time was above the straggler factor."""
    pod: str = ""
    node: str = ""
    reports: int = 0
    """Consecutive reports above the factor (0: its newest was not)."""
    report_time: float | None = None
    """The newest report counted (a report is counted once)."""
    ratio: float | None = None
    """Its compute time over the other pods' median, in the newest report."""
    flagged_time: float | None = None
    """When the streak reached faultTolerance.stragglerReports (None: not a straggler now)."""


@dataclass
class AttemptStatus(_Written):
    """One attempt of the run, from its start to the end of its teardown (status.current);
    the next attempt starts with a new one. Failures (status.failures) name attempts by number."""
    start_time: float | None = None
    gang_running_time: float | None = None
    """When every pod of the attempt was Running."""
    resume_checkpoint: CheckpointRef | None = None
    """The checkpoint the attempt was started with."""
    last_step: int | None = None
    last_step_time: float | None = None
    """When the operator saw the attempt's step advance (the hang clock)."""
    teardown_start_time: float | None = None
    """When the attempt failed and its pods were told to stop."""
    stop_grace_seconds: float | None = None
    """The longest grace the stop orders of this teardown gave (teardownGraceSeconds when each
    was written): every agent's answer is due within it and ANSWER_SLACK_SECONDS, whatever the
    spec says since, and whatever a pod's annotations say."""
    restart_not_before: float | None = None
    """Backoff: the next attempt starts no earlier."""
    preflight_seconds: float | None = None
    """What this attempt's pre-flight check took (its first progress report says)."""
    restore_seconds: float | None = None
    """What restoring this attempt's checkpoint took (its first progress report says)."""
    restore_source: RestoreSource | None = None
    """Where that restore read the state from: node memory, a peer node's memory, or the store
    (checkpoint.memory), the slowest rank's."""
    preflight_trusted: list[str] = field(default_factory=list)
    """Nodes this attempt's pods were told passed the check recently: when every pod is on one,
    the check is skipped (faultTolerance.preflightSkipMinutes)."""
    late_culprit: str = ""
    """The node of a pod that reported a hardware fault only in this attempt's teardown (one per
    teardown: the others were stopped with it)."""
    stragglers: list[StragglerStreak] = field(default_factory=list)
    """Pods with a straggler streak going (faultTolerance.stragglers); a list, so that the
    status's merge patch replaces it whole and a streak that ended goes."""
    gang_attempt: int | None = None
    """The attempt whose pods this attempt runs in (their names and labels carry it): an
    in-place restart keeps the gang; None: the attempt's own pods."""
    pod_names: list[str] = field(default_factory=list)
    """By index, the pod that runs it, once a pod was replaced (by a newer attempt's pod or a
    spare); empty: every index runs in gangAttempt's pod, ``<run>-a<gangAttempt>-<index>``."""
    replacing: int | None = None
    """While Restarting with restart replace: the index whose pod is being replaced."""
    replacement: str = ""
    """While Restarting with restart replace: the pod that takes that index, a spare
    (faultTolerance.spares) or a new pod under the next attempt's name; it waits at the barrier
    with the others."""
    replacement_since: float | None = None
    """When that pod was asked for (a spare given the index, or the new pod first ordered
    created): the replacement's schedule and startup timeouts count from here."""
    restart: RestartKind | None = None
    """How this attempt's failure is being restarted (while Restarting)."""
    in_place_streak: int = 0
    """In-place restarts of this gang in a row without the checkpoint step advancing."""
    preflight_check: bool = False
    """An attempt restarted in place whose agents run the pre-flight check again (after a hang)."""
    skipped_checkpoint: str = ""
    """A complete checkpoint this attempt did not resume from because it was damaged, and why
    ("<tag>: <error>"; the pods took the previous complete one, and left the tag in place)."""


@dataclass
class Suspension(_Written):
    """Time the run spent suspended (spec.suspend, e.g. by Kueue): neither productive nor lost
    in goodput; restarting after a resume is lost (schedule), like the first start."""
    since: float | None = None
    """When the current suspension began (None: not suspended)."""
    seconds: float = 0.0
    """Finished suspensions, in total."""
    resumed_time: float | None = None
    """The last resume, while its attempt does not train yet."""
    restart_seconds: float = 0.0
    """Resume -> training again, over every resume."""
    step: int | None = None
    """The newest step trained before the last resume."""
    recompute_seconds: float = 0.0
    """Steps trained after the checkpoint a resume started from, trained again, over every resume."""


@dataclass
class QueueStatus(_Written):
    """The run's place in Kueue (a run labelled kueue.x-k8s.io/queue-name): its Workload, and
    what Kueue last said of it."""
    workload: str = ""
    """The Workload's name (kueue.x-k8s.io, in the run's namespace, owned by the run)."""
    state: QueueState = "Queued"
    """Queued: waiting for quota; Admitted: the gang may run; Evicted or Preempted: Kueue took
    the quota back, the gang stopped at a save and waits to be admitted again; Finished: the
    quota is freed."""
    reason: str = ""
    """Kueue's reason (its condition's): e.g. Pending, QuotaReserved, Preempted, PodsReadyTimeout."""
    message: str = ""
    """Kueue's message, e.g. why the quota does not fit."""
    cluster_queue: str = ""
    """The ClusterQueue that admitted it (while admitted)."""
    since: float | None = None
    """When the state began."""
    evictions: int = 0
    """Times Kueue evicted or preempted the run (each a graceful stop, not a failure)."""
    deactivated: bool = False
    """The run deactivated its Workload (spec.suspend): it activates it again on resume."""


@dataclass
class FailureCounters(_Written):
    """What the failure policy counts, over every failure of the run (status.failures keeps
    only the newest MAX_FAILURES_KEPT records): restart budgets, backoff, the no-progress guard."""
    recent: dict[str, list[float]] = field(default_factory=dict)
    """Cause -> detection times of its failures within the budget window (older ones pruned;
    at most MAX_RECENT_KEPT each)."""
    streak: int = 0
    """Job-caused failures (application, hang) in a row at ``streakCheckpointStep``;
    infrastructure failures neither add to it nor break it."""
    streak_checkpoint_step: int | None = None


MAX_RECENT_KEPT = 1000
"""Failure times kept per cause: a budget larger than this counts as this."""


@dataclass
class TrainingRunStatus(_Written):
    OPEN: ClassVar[bool] = True  # kopf keeps its handler progress under status.kopf

    phase: Phase | None = None
    message: str = ""
    observed_generation: int | None = None
    conditions: list[Condition] = field(default_factory=list)
    world_size: int | None = None
    data_parallel: int | None = None
    """Data-parallel degree of our trainer's layout (not set for a command trainer)."""
    attempt: int = 0
    """The current attempt's number; pods of other attempts are torn down before a new one starts."""
    current: AttemptStatus = field(default_factory=AttemptStatus)
    """The current attempt's clocks, replaced whole when the next attempt starts."""
    created_time: float | None = None
    step: int | None = None
    tokens: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eval_perplexity: float | None = None
    first_progress_time: float | None = None
    first_progress_steps: int | None = None
    """Steps trained by ``first_progress_time`` (training began that many step times earlier): 1
    where the trainer reports its first step's end."""
    last_progress_time: float | None = None
    step_seconds: float | None = None
    """Smoothed seconds per step."""
    last_checkpoint: CheckpointRef | None = None
    """The newest complete checkpoint the run's pods report (they list the store, which the
    operator cannot see); kept while no pod reports."""
    checkpoint_save_failures: int = 0
    """Saves failed since the last one that completed, as the pods report (0 while they complete)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts so far by cause."""
    restart_count: int = 0
    restarts_in_place: int = 0
    """Of restartCount, the restarts done in place (the gang's pods kept, new workers)."""
    restarts_replaced: int = 0
    """Of restartCount, the restarts that replaced only the failed pod (the others kept, new
    workers in them)."""
    spares: list[str] = field(default_factory=list)
    """Standby pods (faultTolerance.spares) placed and started, their agents waiting: a
    replaced pod's index goes to one of them at once."""
    spares_created: int = 0
    """Spare pods created so far (the newest is ``<run>-spare-<sparesCreated>``)."""
    spares_requested_time: float | None = None
    """When the newest spare was created: until it is seen (or SPARE_SETTLE_SECONDS pass), no
    other is (the pass after a create may not see the new pod yet)."""
    spares_refused: int = 0
    """Spare creations the API server refused in a row (a quota, an admission webhook)."""
    spares_retry_time: float | None = None
    """After a refused spare, when the next may be created (a backoff doubling per refusal)."""
    quarantined_nodes: list[str] = field(default_factory=list)
    quarantine_pending: list[str] = field(default_factory=list)
    """Quarantined nodes not yet seen with the taint: the taint is ordered again every pass until
    the operator's node cache shows it (a node seen tainted and later without it was returned by
    an admin; one never seen tainted was not quarantined yet)."""
    quarantined_machines: list[QuarantinedMachine] = field(default_factory=list)
    """The machines behind the quarantined nodes, and behind those whose Node object went
    (QuarantinedMachine): a node registered again is quarantined again when it is the same machine."""
    avoided_nodes: list[AvoidedNode] = field(default_factory=list)
    """Nodes this run's own pods named as faulty (the Neuron runtime's words in a termination
    message, a straggler, a late culprit in teardown): this run's pods stay off them for
    faultTolerance.budgetWindowMinutes, but no taint is written, because a run's pods do not
    judge a node for the whole cluster (unless the operator runs with --trust-pod-fault-reports,
    which quarantines them instead). They count toward maxQuarantinedNodes while avoided."""
    node_repairs: list[NodeRepair] = field(default_factory=list)
    """The quarantined or avoided nodes that EKS node auto repair is to replace (NodeRepair)."""
    failures: list[FailureRecord] = field(default_factory=list)
    """The newest failures (at most MAX_FAILURES_KEPT); older ones live on in goodputArchive."""
    failure_count: int = 0
    suspension: Suspension | None = None
    """Time held (spec.suspend, or Kueue's queue: see HELD), which leaves goodput's wall time."""
    queue: QueueStatus | None = None
    """Kueue's admission of the run (None: the run is not queued with Kueue)."""
    failure_counters: FailureCounters | None = None
    """Running counts of every failure for the failure policy (None: an older operator's
    status; counted from status.failures then)."""
    preflight_seconds: float = 0.0
    """Every attempt's pre-flight check, in total (goodput's preflight phase)."""
    restore_seconds: float = 0.0
    """Every attempt's checkpoint restore, in total (goodput's restore phase)."""
    preflight_passed: list[PreflightPass] = field(default_factory=list)
    """Nodes that passed this run's pre-flight check within faultTolerance.preflightSkipMinutes."""
    goodput_archive: GoodputArchive | None = None
    goodput: Goodput | None = None
    disruption: Disruption | None = None
    """A mass node disruption in progress: lost nodes and hangs are held."""
    disruption_end_time: float | None = None
    fault_tolerance_in_force: dict | None = None
    """spec.faultTolerance as last accepted (the only group a live run may edit besides suspend):
    an edit the operator refuses leaves the run supervised with this, and Valid=False."""

    @property
    def quarantine_names(self) -> set[str]:
        """The node names the run quarantined, and those of the quarantined machines it
        remembers (their Node objects went): left out of the run's own nodes."""
        return {*self.quarantined_nodes, *(m.node for m in self.quarantined_machines)}

    @property
    def kept_off_names(self) -> set[str]:
        """The node names the run keeps its pods off: quarantine_names and the avoided nodes."""
        return self.quarantine_names | {a.node for a in self.avoided_nodes}


MAX_FAILURES_KEPT = 50
