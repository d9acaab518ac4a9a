"""What one pass sees of a run, as one typed Snapshot. Pure, apart from DeviceShortfalls' memory.

The Watcher (watcher.py) builds a Snapshot from kopf's indices and the operator-wide signals
(mass disruption, API outage, the applier's last refusal); reconcile.reconcile decides on it
alone. The spec is parsed here once per pass: the snapshot carries the spec in force and
the error that refused it (a new run's invalid spec, or an edit of a live run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from dataclasses import dataclass

from trainium_api.fields import ConfigError
from trainium_api.gangorder import GangOrder
from trainium_api.load import lenient
from trainium_api.spec import (EFA_DEVICE_CLASS, INSTANCE_TYPES, NEURON_DEVICE_CLASS, TrainingRunSpec,
                               check_run_name)
from trainium_api.status import CheckpointRef, TrainingRunStatus

from .hostaccess import HostAccess
from .observe import GangOrderView, NodeView, PodView
from . import store
from .disruption_guard import DisruptionGuard
from .spec import parse
from .workload import FlavorView, WorkloadView
from . import queueing


@dataclass(frozen=True)
class Snapshot:
    run: dict
    """The run as read: metadata, spec (raw), status (raw)."""
    status: TrainingRunStatus
    spec: TrainingRunSpec | None
    """The spec in force; None when there is none (a new run's spec is invalid)."""
    spec_error: ConfigError | None
    """Why the spec as written is refused (with ``spec`` set: an edit of a live run refused,
    the run goes on with the spec in force)."""
    pods: list[PodView]
    nodes: dict[str, NodeView]
    now: float
    checkpoint: CheckpointRef | None = None
    """The newest complete checkpoint the run's pods report (store.newest_reported), or None."""
    disruption: str = ""
    """Why the run's nodes look lost through no fault of their own (policy.disruption); "" when
    they do not."""
    guard: DisruptionGuard = DisruptionGuard()
    api_outage: tuple[float, float] | None = None
    """(lost, back) of the operator's last loss of the API server (back = now while it lasts)."""
    children_error: str = ""
    """Why the applier could not create a child or a pod in the last pass ("" when it could)."""
    children_error_since: float | None = None
    """Since when creates have been refused without a break."""
    host: HostAccess = HostAccess()
    """What the run's pods may take from their nodes (the operator's configuration)."""
    workload: WorkloadView | None = None
    """The run's Kueue Workload (a run labelled kueue.x-k8s.io/queue-name), as seen; None while
    there is none of this run's."""
    flavors: dict[str, FlavorView] = dataclasses.field(default_factory=dict)
    """Kueue's ResourceFlavors by name (read only for a run with a Workload)."""
    device_classes: frozenset[str] = frozenset()
    """The cluster's DRA DeviceClasses (the watcher reads them at most every 30 s)."""
    plugin_types: frozenset[str] = frozenset()
    """Instance types of which some node has Neuron devices through the device plugin
    (allocatable aws.amazon.com/neuron): resources Auto keeps the device plugin for those."""
    mass_event: bool = False
    """``disruption`` is a mass event's (mass_events): it holds fleet symptoms and hangs only."""
    gang_order: GangOrder | None = None
    """The run's gang order as seen (trainium_api.gangorder); None while there is none of this run's."""
    departed: tuple[PodView, ...] = ()
    """The last view of the run's pods seen deleting or deleted lately that are no longer among
    ``pods`` (departures.py: an evicted pod can be gone before a pass sees it)."""

    @property
    def deleting(self) -> bool:
        return bool(self.run["metadata"].get("deletionTimestamp"))


def read_status(raw: dict | None) -> TrainingRunStatus:
    """The run's status, typed; a field that does not load (edited by hand) takes its default."""
    return lenient(TrainingRunStatus, raw or {})


def snapshot(run: dict, pods: list[PodView], nodes: dict[str, NodeView], now: float,
             checkpoint: dict | CheckpointRef | None = None, disruption: str = "",
             guard: DisruptionGuard = DisruptionGuard(), api_outage: tuple[float, float] | None = None,
             children_error: str = "", host: HostAccess = HostAccess(),
             status: TrainingRunStatus | None = None, workload: WorkloadView | None = None,
             flavors: dict[str, FlavorView] | None = None, children_error_since: float | None = None,
             device_classes: frozenset[str] = frozenset(), plugin_types: frozenset[str] = frozenset(),
             mass_event: bool = False, gang_order: GangOrderView | None = None,
             departed: list[PodView] | tuple[PodView, ...] = ()) -> Snapshot:
    """``status``: the run's status read already (read_status of run["status"]); parsing a
    status that keeps 50 failures takes milliseconds, every pass."""
    status = read_status(run.get("status")) if status is None else status
    spec, error = spec_in_force(run, status, host)
    if checkpoint is not None and not isinstance(checkpoint, CheckpointRef):
        checkpoint = lenient(CheckpointRef, checkpoint)
    pods = [_clock_checked(p, now) for p in pods]
    if checkpoint is None and spec is not None:  # the pods read the store; the operator cannot
        checkpoint = store.newest_reported([p for p in pods if not p.spare], spec)
    if workload is not None and workload.owner != run["metadata"].get("uid"):
        workload = None  # an earlier run's of the same name, on its way out
    if spec is not None:
        spec = devices_in_force(spec, device_classes, plugin_types)
    if spec is not None and workload is not None and workload.admitted:
        spec = queueing.admitted_spec(spec, workload, flavors or {})
    ours = gang_order is not None and gang_order.owner == run["metadata"].get("uid")  # (not an earlier run's)
    present = {x.name for x in pods}
    return Snapshot(run, status, spec, error, pods, nodes, now, checkpoint, disruption, guard, api_outage,
                    children_error, children_error_since, host, workload, dict(flavors or {}), device_classes,
                    plugin_types, mass_event, gang_order.order if ours else None,
                    tuple(d for d in departed if d.name not in present))


_RESOLVED: dict[tuple[int, str, bool], tuple[TrainingRunSpec, TrainingRunSpec]] = {}
_RESOLVED_LOCK = threading.Lock()


def devices_in_force(spec: TrainingRunSpec, device_classes: frozenset[str],
                     plugin_types: frozenset[str] = frozenset()) -> TrainingRunSpec:
    """``spec`` with spec.resources resolved against the cluster: Auto is DRA where the Neuron DRA
    driver's DeviceClass exists and no node of the run's instance type has its devices through the
    device plugin (the two never share a node; a cluster may run each on its own node groups),
    always for a DRA-only instance type, else DevicePlugin; with DRA, dra_efa where the EFA DRA
    driver's class exists too. The same object for the same spec
    and cluster (plan caches by the spec object): a spec is never changed in place."""
    itype = INSTANCE_TYPES[spec.instance_type]
    if not itype["neuron"]:
        return spec
    mode = spec.resources
    if mode == "Auto":
        mode = "DRA" if itype.get("dra_only") or (NEURON_DEVICE_CLASS in device_classes
                                                  and spec.instance_type not in plugin_types) else "DevicePlugin"
    efa = mode == "DRA" and EFA_DEVICE_CLASS in device_classes
    if (mode, efa) == (spec.resources, spec.dra_efa):
        return spec
    key = (id(spec), mode, efa)
    with _RESOLVED_LOCK:
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0] is spec:
            return hit[1]
        resolved = dataclasses.replace(spec, resources=mode, dra_efa=efa)
        if len(_RESOLVED) >= 512:
            _RESOLVED.clear()
        _RESOLVED[key] = (spec, resolved)  # (the spec is kept: its id stays its own)
        return resolved


MAX_CLOCK_AHEAD_SECONDS = 300.0
"""A progress report's step end time further ahead of the operator's clock than this is a
pod's clock that jumped (an NTP step, a wrong host clock): the time is dropped, not used."""


def _clock_checked(pod: PodView, now: float) -> PodView:
    """``pod`` without a progress time from the future (step times, goodput and the hang clock
    would follow it), nor a checkpoint time from the future (the checkpoint-age alert would
    follow it); each drop is named in its progress errors (the ProgressValid condition)."""
    seen = pod.store.checkpoint if pod.store is not None else None
    if seen is not None and seen.time is not None and seen.time > now + MAX_CLOCK_AHEAD_SECONDS:
        pod = dataclasses.replace(pod, store=dataclasses.replace(pod.store, checkpoint=dataclasses.replace(
            seen, time=None)), progress_errors=[*pod.progress_errors, f"checkpoint.time: {seen.time - now:.0f}s "
                                                f"ahead of the operator's clock; dropped"])
    at = pod.progress.time if pod.progress else None
    if not isinstance(at, (int, float)) or at <= now + MAX_CLOCK_AHEAD_SECONDS:
        return pod
    return dataclasses.replace(pod, progress=dataclasses.replace(pod.progress, time=None), progress_errors=[
        *pod.progress_errors, f"time: {at - now:.0f}s ahead of the operator's clock; dropped"])


def spec_in_force(run: dict, status: TrainingRunStatus,
                  host: HostAccess = HostAccess()) -> tuple[TrainingRunSpec | None, ConfigError | None]:
    """The spec as written when the operator's rules (and its host access) accept it. Otherwise,
    for a run whose spec was accepted before (suspended or started), its spec with the fault
    tolerance last accepted (the API server lets only faultTolerance and suspend change), and
    the error; else None."""
    try:
        bad_name = check_run_name(run["metadata"].get("name"))
        if bad_name:  # made before the CRD's rule existed: it can never get its Service
            raise ConfigError("metadata.name", bad_name.removeprefix("metadata.name "))
        spec = _parsed(run.get("spec"), host)
        # per namespace, so not in the parse cache; a run accepted before the operator's stores
        # narrowed is supervised below
        host.check_checkpoint_store(spec.run.checkpoint.uri, run["metadata"].get("namespace") or "")
        return spec, None
    except ConfigError as err:
        if status.fault_tolerance_in_force is None or not isinstance(run.get("spec"), dict):
            return None, err
        try:
            # a run already accepted keeps being supervised (Valid=False names the field), its
            # volumes as they were: the API server lets none of them change, and a run whose host
            # access the operator's configuration narrowed later must not be left unsupervised.
            # Its pod template may have changed while it was suspended: that is checked in full
            # (_checked), so no pod is made from a refused one
            return _parsed({**run["spec"], "faultTolerance": status.fault_tolerance_in_force}, None), err
        except ConfigError:
            return None, err


def _parsed(body, host: HostAccess | None) -> TrainingRunSpec:
    """parse(body) and the host-access check (``host`` None: a run accepted before, see
    spec_in_force), once per distinct spec: a run's spec rarely changes, and parsing it was the
    largest part of a pass. The same spec object comes back for the same spec
    (plan.rendered_config caches by it); nothing changes a parsed spec."""
    try:
        text = json.dumps(body)  # in its own key order: the parser names the first bad field in that order
    except (TypeError, ValueError):  # not JSON (never from the API server): parsed uncached
        hit = _checked(body, host)
    else:
        hit = _parsed_text(text, host)
    if isinstance(hit, ConfigError):
        raise ConfigError(hit.field, hit.message)  # a fresh one: a raised exception keeps its traceback
    return hit


@functools.lru_cache(maxsize=256)  # a spec is a few kB; the schema allows far larger ones
def _parsed_text(text: str, host: HostAccess | None) -> TrainingRunSpec | ConfigError:
    return _checked(json.loads(text), host)


def _checked(body, host: HostAccess | None) -> TrainingRunSpec | ConfigError:
    try:
        spec = parse(body, accepted_before=host is None)
        if host is not None:
            host.check_volumes(spec.volumes, spec.volume_mounts, spec.pod_template.spec.init_containers)
        else:  # a run accepted before: its volumes' prefixes as they were, but a host path stays read-only
            HostAccess.check_read_only(spec.volumes, [], spec.pod_template.spec.init_containers)
        return spec
    except ConfigError as err:
        return err


class DeviceShortfalls:
    """Since when each node has shown fewer allocatable Neuron devices than its capacity, as
    this operator saw it (the node object carries no time for it). Forgotten when the node is
    whole again, or when no pass has looked at the node for SHORTFALL_GAP_SECONDS (a run moved
    off it: a shortfall seen again days later is a new one, and settles again); an operator
    started anew sees a shortfall as new, so it settles once more (judge:
    guard.device_settle_seconds), which delays detection but never invents a failure."""

    SHORTFALL_GAP_SECONDS = 60.0
    """Longer than any gap between two passes of a live run (its error backoff stops at 30 s)."""

    def __init__(self):
        self._lock = threading.Lock()  # passes of different runs run on different threads
        self._since: dict[str, tuple[float, float]] = {}  # node -> (since, last seen short)

    def mark(self, nodes: dict[str, NodeView], now: float) -> dict[str, NodeView]:
        with self._lock:
            out = {}
            for name, n in nodes.items():
                if n.neuron_short:
                    since, seen = self._since.get(name, (now, now))
                    if now - seen > self.SHORTFALL_GAP_SECONDS:
                        since = now
                    self._since[name] = (since, now)
                    out[name] = dataclasses.replace(n, neuron_short_since=since)
                else:
                    self._since.pop(name, None)
                    out[name] = n
            return out
