"""The operator's Prometheus series (served on /metrics by prometheus-client).

Per-run gauges are set from the run's status on every reconcile pass, so an operator that was
restarted exports the same values at once (status is the memory; see reconcile.py). Only the
latency histograms start empty after a restart. The Helm chart's alerts and Grafana dashboard
(charts/trainium-operator) are written against these names; tests/chart/test_alerts.py and the
Prometheus test in tests/chart/test_install.py keep them in step.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from trainium_api.checkpoints import RESTORE_SOURCES
from trainium_api.spec import CAUSES, TrainingRunSpec
from trainium_api.status import PHASES as PHASES_OF_RUN
from trainium_api.status import RESTART_KINDS, FailureRecord, TrainingRunStatus

from .goodput import PHASES, RESTART_FIELDS
from .judge import hang_timeout

RUN = ["namespace", "run"]
PHASE_NAMES = ("Pending", *PHASES_OF_RUN)  # Pending: created, not yet reconciled


FORGOTTEN_KEPT = 10_000  # deleted runs remembered against late passes (a pass ends in seconds)


class Metrics:
    """One operator's series, in a registry of their own: made at start-up (never at import),
    so two operators in one process (the in-process tests) export nothing of each other's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def run_gauge(name: str, doc: str, extra: list[str] | None = None) -> Gauge:
            return Gauge(name, doc, RUN + (extra or []), registry=self.registry)

        self.phase = run_gauge("trainium_run_phase", "1 for the run's current phase, 0 for the others", ["phase"])
        self.restarts = run_gauge("trainium_run_restarts", "Gang restarts so far, by cause (status.restarts)",
                                  ["cause"])
        self.restarts_in_place = run_gauge("trainium_run_restarts_in_place", "Of the gang restarts, those done in "
                                           "place: the gang's pods kept, new workers (status.restartsInPlace)")
        self.spares_ready = run_gauge("trainium_run_spares_ready", "Standby pods placed, started and waiting to "
                                      "take a lost pod's place (status.spares; faultTolerance.spares wanted)")
        self.restarts_replaced = run_gauge("trainium_run_restarts_replaced", "Of the gang restarts, those that "
                                           "replaced only the failed pod, the others kept (status.restartsReplaced)")
        self.restarts_by_kind = run_gauge("trainium_run_restarts_by_kind", "Gang restarts so far by how each was "
                                          "done (restart: inPlace, replace, recreate)", ["restart"])
        self.restore_source = run_gauge("trainium_run_restore_source", "1 for where the current attempt's restore "
                                        "read its state from (status.current.restoreSource: memory, peer or store), "
                                        "0 for the others; absent before it resumed", ["source"])
        self.pod_node = run_gauge("trainium_run_pod_node", "1 for each pod of the current attempt placed on a node: "
                                  "its node and the node's EC2 instance id (spec.providerID), to join the node's "
                                  "own series (neuron-monitor's, labelled instance_id) to the run",
                                  ["pod", "node", "instance_id"])
        self.goodput_ratio = run_gauge("trainium_run_effective_training_ratio", "Productive / wall time since creation")
        self.lost = run_gauge("trainium_run_lost_seconds", "Lost time by phase (detect, teardown, schedule, recompute)",
                              ["phase"])
        self.lost_by_restart = run_gauge("trainium_run_restart_lost_seconds", "Lost time of the failures restarted "
                                         "each way (restart: inPlace, replace, recreate), by phase "
                                         "(status.goodput.byRestart)", ["restart", "phase"])
        self.step = run_gauge("trainium_run_step", "Newest step reported by the gang")
        self.last_step_time = run_gauge("trainium_run_last_step_timestamp_seconds",
                                        "When the reported step last advanced")
        self.tokens_per_second = run_gauge("trainium_run_tokens_per_second", "Tokens per second of the gang")
        self.loss = run_gauge("trainium_run_loss", "Newest training loss reported by the gang")
        self.eval_perplexity = run_gauge("trainium_run_eval_perplexity", "Newest held-out perplexity (data.heldOut)")
        self.checkpoint_step = run_gauge("trainium_run_last_checkpoint_step", "Step of the newest complete checkpoint")
        self.checkpoint_time = run_gauge("trainium_run_last_checkpoint_timestamp_seconds",
                                         "When the newest complete checkpoint was finished")
        self.checkpoint_save_failures = run_gauge("trainium_run_checkpoint_save_failures",
                                                  "Checkpoint saves failed since the last one that completed, as the "
                                                  "pods report (status.checkpointSaveFailures; 0 while saves "
                                                  "complete)")
        self.checkpoint_interval = run_gauge("trainium_run_checkpoint_interval_seconds",
                                             "Expected seconds between checkpoints (intervalMinutes, or intervalSteps "
                                             "x the observed step time, whichever is shorter)")
        self.hang_timeout_seconds = run_gauge("trainium_run_hang_timeout_seconds",
                                              "No-progress time after which the operator restarts the gang as hung")
        self.created_time = run_gauge("trainium_run_created_timestamp_seconds", "When the operator started the run")
        self.quarantined = run_gauge("trainium_run_quarantined_nodes", "Nodes the run quarantined that are still "
                                     "tainted")
        self.stragglers = run_gauge("trainium_run_stragglers", "Pods of the current attempt flagged as stragglers "
                                    "(faultTolerance.stragglers; status.current.stragglers)")
        self.api_unreachable = Gauge("trainium_operator_api_unreachable",
                                     "1 while this operator cannot reach the API server (its /readyz probe fails or "
                                     "is slow): hang and lost-node detection are held", registry=self.registry)
        self.reconcile_errors = Counter("trainium_reconcile_errors", "Reconcile passes that raised", RUN,
                                        registry=self.registry)
        self.api_paced = Counter("trainium_operator_api_paced_seconds", "Seconds the operator's API requests "
                                 "waited for its client's pace (--api-qps, --api-burst; ratelimit.py)",
                                 registry=self.registry)
        self.reconcile_passes = Counter("trainium_reconcile_passes", "Reconcile passes of the run (a live run passes "
                                        "about once a second, a finished one only when something changes)", RUN,
                                        registry=self.registry)
        self.detection = Histogram("trainium_failure_detection_seconds", "Failure signal to detection", ["cause"],
                                   buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry)
        self.recovery = Histogram("trainium_failure_recovery_seconds", "Detection to the new gang running", ["cause"],
                                  buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800), registry=self.registry)
        self.reconcile_seconds = Histogram("trainium_reconcile_seconds", "Duration of one reconcile pass",
                                           buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=self.registry)
        for cause in CAUSES:  # present from the start, so the first failure of a cause shows as an increase
            self.detection.labels(cause)
            self.recovery.labels(cause)
        self._single = (self.goodput_ratio, self.step, self.last_step_time, self.tokens_per_second, self.loss,
                        self.eval_perplexity, self.checkpoint_step, self.checkpoint_time,
                        self.checkpoint_save_failures, self.checkpoint_interval, self.hang_timeout_seconds,
                        self.created_time, self.quarantined, self.stragglers, self.restarts_in_place,
                        self.restarts_replaced, self.spares_ready)
        self._runs: set[tuple[str, str]] = set()  # the runs this operator exports series of
        # A pass runs on a thread of its own and may end after its run was deleted (forget) or
        # this replica stopped leading (forget_all): under this lock, a pass's export checks
        # both, so a ghost's series never come back
        self._lock = threading.RLock()
        self._forgotten: dict[str, None] = {}  # uids of deleted runs, oldest first (bounded)
        self._pod_nodes: dict[tuple[str, str], set[tuple[str, str, str]]] = {}  # run -> its pod_node series

    def serve(self, port: int):
        """/metrics on ``port``, from a daemon thread; returns (server, thread) to stop it."""
        return start_http_server(port, registry=self.registry)

    def api_away(self, away: bool) -> None:
        """ApiHealth's on_change: 1 while the API server is unreachable."""
        self.api_unreachable.set(1 if away else 0)

    def observe_run(self, namespace: str, run: str, spec: TrainingRunSpec | None, status: TrainingRunStatus,
                    placed: dict[str, tuple[str, str]] | None = None, uid: str = "",
                    leading: Callable[[], bool] | None = None) -> None:
        """Export one run's state (its status after this pass); ``placed``: the current attempt's
        pods on nodes, pod -> (node, instance id), from the pass's snapshot (None: unchanged).
        Nothing when the run (``uid``) was deleted meanwhile, or this replica no longer leads."""
        with self._lock:
            if (uid and uid in self._forgotten) or (leading is not None and not leading()):
                return
            self._observe_run(namespace, run, spec, status, placed)

    def _observe_run(self, namespace: str, run: str, spec: TrainingRunSpec | None, status: TrainingRunStatus,
                     placed: dict[str, tuple[str, str]] | None) -> None:
        labels = (namespace, run)
        self._runs.add(labels)
        # restartCount counts every gang restart; in place and replaced are its parts, the rest recreated
        recreated = max(0, status.restart_count - status.restarts_in_place - status.restarts_replaced)
        by_kind = {"inPlace": status.restarts_in_place, "replace": status.restarts_replaced, "recreate": recreated}
        for kind in RESTART_KINDS:
            self.restarts_by_kind.labels(*labels, kind).set(by_kind[kind])
        source = status.current.restore_source
        for s in RESTORE_SOURCES:
            if source is None:
                with suppress(KeyError):
                    self.restore_source.remove(*labels, s)
            else:
                self.restore_source.labels(*labels, s).set(1 if s == source else 0)
        if placed is not None:
            self._place(labels, {(pod, node, iid) for pod, (node, iid) in placed.items()})
        for p in PHASE_NAMES:
            self.phase.labels(*labels, p).set(1 if (status.phase or "Pending") == p else 0)
        for cause in CAUSES:
            self.restarts.labels(*labels, cause).set(status.restarts.get(cause, 0))
        self.restarts_in_place.labels(*labels).set(status.restarts_in_place)
        self.restarts_replaced.labels(*labels).set(status.restarts_replaced)
        self.spares_ready.labels(*labels).set(len(status.spares))
        gp = status.goodput
        _set(self.goodput_ratio, labels, gp.effective_ratio if gp else None)
        for p in PHASES:
            self.lost.labels(*labels, p).set(getattr(gp.lost_seconds, p) if gp else 0.0)
            for kind, name in RESTART_FIELDS.items():
                self.lost_by_restart.labels(*labels, kind, p).set(getattr(getattr(gp.by_restart, name), p)
                                                                  if gp else 0.0)
        _set(self.step, labels, status.step)
        if status.current.last_step_time:  # cleared at a new attempt's start; keep the previous value until then
            self.last_step_time.labels(*labels).set(status.current.last_step_time)
        _set(self.tokens_per_second, labels, status.tokens_per_second)
        _set(self.loss, labels, status.loss)
        _set(self.eval_perplexity, labels, status.eval_perplexity)
        ck = status.last_checkpoint
        _set(self.checkpoint_step, labels, ck.step if ck else None)
        _set(self.checkpoint_time, labels, ck.time if ck else None)
        self.checkpoint_save_failures.labels(*labels).set(status.checkpoint_save_failures)
        _set(self.created_time, labels, status.created_time)
        self.quarantined.labels(*labels).set(len(status.quarantined_nodes))
        self.stragglers.labels(*labels).set(sum(s.flagged_time is not None for s in status.current.stragglers))
        if spec is not None:
            _set(self.checkpoint_interval, labels, expected_checkpoint_interval(spec, status.step_seconds))
            _set(self.hang_timeout_seconds, labels, hang_timeout(spec, status.step_seconds))

    def _place(self, labels: tuple[str, str], series: set[tuple[str, str, str]]) -> None:
        old = self._pod_nodes.get(labels, set())
        for gone in old - series:  # pods of an earlier attempt, or moved
            with suppress(KeyError):
                self.pod_node.remove(*labels, *gone)
        for new in series - old:  # (the others are exported already: a pass over 4,096 pods sets none)
            self.pod_node.labels(*labels, *new).set(1)
        self._pod_nodes[labels] = series

    def observe_failure(self, failure: FailureRecord) -> None:
        """A failure newly recorded in status.failures (once per record: reconcile's effect)."""
        if failure.detected_after is not None:
            self.detection.labels(failure.cause).observe(failure.detected_after)

    def observe_recovery(self, failure: FailureRecord) -> None:
        """A failure whose new gang is now all Running (once per record)."""
        if failure.recovered_after is not None:
            self.recovery.labels(failure.cause).observe(failure.recovered_after)

    def count_error(self, namespace: str, run: str) -> None:
        self.reconcile_errors.labels(namespace, run).inc()

    def count_pass(self, namespace: str, run: str) -> None:
        self.reconcile_passes.labels(namespace, run).inc()

    def forget(self, namespace: str, run: str, uid: str = "") -> None:
        """Drop a deleted run's series, so dashboards and alerts do not keep a ghost; with its
        ``uid``, a pass of it still under way exports nothing after this."""
        with self._lock:
            if uid:
                self._forgotten[uid] = None
                while len(self._forgotten) > FORGOTTEN_KEPT:
                    del self._forgotten[next(iter(self._forgotten))]
            self._forget(namespace, run)

    def _forget(self, namespace: str, run: str) -> None:
        labels = (namespace, run)
        self._runs.discard(labels)
        for gauge, extra in ((self.phase, PHASE_NAMES), (self.restarts, CAUSES), (self.lost, PHASES)):
            for value in extra:
                with suppress(KeyError):
                    gauge.remove(*labels, value)
        for kind in RESTART_FIELDS:
            for p in PHASES:
                with suppress(KeyError):
                    self.lost_by_restart.remove(*labels, kind, p)
        for gauge, extra in ((self.restarts_by_kind, RESTART_KINDS), (self.restore_source, RESTORE_SOURCES)):
            for value in extra:
                with suppress(KeyError):
                    gauge.remove(*labels, value)
        self._place(labels, set())
        self._pod_nodes.pop(labels, None)
        for gauge in self._single + (self.reconcile_errors, self.reconcile_passes):
            _set(gauge, labels, None)

    def forget_all(self) -> None:
        """Drop every run's series: this replica stopped leading, so it no longer follows any
        run, and what it last exported (a phase, a checkpoint time) would keep alerts firing for
        runs that have since ended or gone while another replica led."""
        with self._lock:
            for namespace, run in list(self._runs):
                self._forget(namespace, run)


EC2_PROVIDER_ID = re.compile(r"aws:///[^/]{1,64}/(i-[0-9a-f]{8,17})")


def instance_id(provider_id: str) -> str:
    """The EC2 instance id in a node's spec.providerID (aws:///<zone>/<instance-id>); "" for
    another provider, none, or anything else written there (never a label value of any size)."""
    m = EC2_PROVIDER_ID.fullmatch(provider_id)
    return m.group(1) if m else ""


def placed_pods(current: list[str], pods, nodes) -> dict[str, tuple[str, str]]:
    """The pods named ``current`` (the attempt in force's: inplace.gang_names, as an in-place
    restart keeps an earlier attempt's pods) on nodes: pod -> (node, instance id)."""
    names = set(current)
    return {p.name: (p.node, instance_id(nodes[p.node].provider_id) if p.node in nodes else "")
            for p in pods if p.name in names and p.node and not p.deleting
            and p.phase not in ("Succeeded", "Failed")}  # a finished run's pods are not on their nodes


def expected_checkpoint_interval(spec: TrainingRunSpec, step_seconds: float | None) -> float | None:
    """Seconds between two checkpoints, or None while it cannot be known (by steps, before the
    step time was observed; or checkpoints off)."""
    ck = spec.run.checkpoint
    candidates = []
    if ck.interval_minutes > 0:
        candidates.append(ck.interval_minutes * 60.0)
    if ck.interval_steps > 0 and step_seconds:
        candidates.append(ck.interval_steps * step_seconds)
    return min(candidates) if candidates else None


def _set(gauge, labels: tuple, value) -> None:
    """Set, or drop the series when the value is unknown (an absent series is honest; a 0 is not)."""
    if value is None:
        with suppress(KeyError):  # not exported yet
            gauge.remove(*labels)
    else:
        gauge.labels(*labels).set(value)
