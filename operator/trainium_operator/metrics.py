"""The operator's Prometheus series (served on /metrics by prometheus-client).

Per-run gauges are set from the run's status on every reconcile pass, so an operator that was
restarted exports the same values at once (status is the memory; see reconcile.py). Only the
latency histograms start empty after a restart. The Helm chart's alerts and Grafana dashboard
(charts/trainium-operator) are written against these names; tests/chart/test_alerts.py and the
Prometheus test in tests/chart/test_install.py keep them in step.
"""

from __future__ import annotations

from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from trainium_api.spec import CAUSES, TrainingRunSpec
from trainium_api.status import PHASES as PHASES_OF_RUN
from trainium_api.status import FailureRecord, TrainingRunStatus

from .goodput import PHASES, RESTART_FIELDS
from .judge import hang_timeout

REGISTRY = CollectorRegistry()
RUN = ["namespace", "run"]
PHASE_NAMES = ("Pending", *PHASES_OF_RUN)  # Pending: created, not yet reconciled


def _run_gauge(name: str, doc: str, extra: list[str] | None = None) -> Gauge:
    return Gauge(name, doc, RUN + (extra or []), registry=REGISTRY)


phase = _run_gauge("trainium_run_phase", "1 for the run's current phase, 0 for the others", ["phase"])
restarts = _run_gauge("trainium_run_restarts", "Gang restarts so far, by cause (status.restarts)", ["cause"])
restarts_in_place = _run_gauge("trainium_run_restarts_in_place", "Of the gang restarts, those done in place: the "
                               "gang's pods kept, new workers (status.restartsInPlace)")
spares_ready = _run_gauge("trainium_run_spares_ready", "Standby pods placed, started and waiting to take a lost "
                          "pod's place (status.spares; faultTolerance.spares wanted)")
restarts_replaced = _run_gauge("trainium_run_restarts_replaced", "Of the gang restarts, those that replaced only the "
                               "failed pod, the others kept (status.restartsReplaced)")
goodput_ratio = _run_gauge("trainium_run_effective_training_ratio", "Productive / wall time since creation")
lost = _run_gauge("trainium_run_lost_seconds", "Lost time by phase (detect, teardown, schedule, recompute)",
                  ["phase"])
lost_by_restart = _run_gauge("trainium_run_restart_lost_seconds", "Lost time of the failures restarted each way "
                             "(restart: inPlace, replace, recreate), by phase (status.goodput.byRestart)",
                             ["restart", "phase"])
step = _run_gauge("trainium_run_step", "Newest step reported by the gang")
last_step_time = _run_gauge("trainium_run_last_step_timestamp_seconds", "When the reported step last advanced")
tokens_per_second = _run_gauge("trainium_run_tokens_per_second", "Tokens per second of the gang")
loss = _run_gauge("trainium_run_loss", "Newest training loss reported by the gang")
eval_perplexity = _run_gauge("trainium_run_eval_perplexity", "Newest held-out perplexity (data.heldOut)")
checkpoint_step = _run_gauge("trainium_run_last_checkpoint_step", "Step of the newest complete checkpoint")
checkpoint_time = _run_gauge("trainium_run_last_checkpoint_timestamp_seconds",
                             "When the newest complete checkpoint was finished")
checkpoint_save_failures = _run_gauge("trainium_run_checkpoint_save_failures",
                                     "Checkpoint saves failed since the last one that completed, as the pods "
                                     "report (status.checkpointSaveFailures; 0 while saves complete)")
checkpoint_interval = _run_gauge("trainium_run_checkpoint_interval_seconds",
                                 "Expected seconds between checkpoints (intervalMinutes, or intervalSteps x the "
                                 "observed step time, whichever is shorter)")
hang_timeout_seconds = _run_gauge("trainium_run_hang_timeout_seconds",
                                  "No-progress time after which the operator restarts the gang as hung")
created_time = _run_gauge("trainium_run_created_timestamp_seconds", "When the operator started the run")
quarantined = _run_gauge("trainium_run_quarantined_nodes", "Nodes the run quarantined that are still tainted")
stragglers = _run_gauge("trainium_run_stragglers", "Pods of the current attempt flagged as stragglers "
                        "(faultTolerance.stragglers; status.current.stragglers)")
api_unreachable = Gauge("trainium_operator_api_unreachable",
                        "1 while this operator cannot reach the API server (its /readyz probe fails or is "
                        "slow): hang and lost-node detection are held", registry=REGISTRY)
reconcile_errors = Counter("trainium_reconcile_errors", "Reconcile passes that raised", RUN, registry=REGISTRY)
detection = Histogram("trainium_failure_detection_seconds", "Failure signal to detection", ["cause"],
                      buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=REGISTRY)
recovery = Histogram("trainium_failure_recovery_seconds", "Detection to the new gang running", ["cause"],
                     buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800), registry=REGISTRY)
reconcile_seconds = Histogram("trainium_reconcile_seconds", "Duration of one reconcile pass",
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=REGISTRY)

for _cause in CAUSES:  # present from the start, so the first failure of a cause shows as an increase
    detection.labels(_cause)
    recovery.labels(_cause)

_SINGLE = (goodput_ratio, step, last_step_time, tokens_per_second, loss, eval_perplexity, checkpoint_step,
           checkpoint_time, checkpoint_save_failures,
           checkpoint_interval, hang_timeout_seconds, created_time, quarantined, stragglers, restarts_in_place,
           restarts_replaced, spares_ready)


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)


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


def observe_run(namespace: str, run: str, spec: TrainingRunSpec | None, status: TrainingRunStatus) -> None:
    """Export one run's state (its status after this pass)."""
    labels = (namespace, run)
    for p in PHASE_NAMES:
        phase.labels(*labels, p).set(1 if (status.phase or "Pending") == p else 0)
    for cause in CAUSES:
        restarts.labels(*labels, cause).set(status.restarts.get(cause, 0))
    restarts_in_place.labels(*labels).set(status.restarts_in_place)
    restarts_replaced.labels(*labels).set(status.restarts_replaced)
    spares_ready.labels(*labels).set(len(status.spares))
    gp = status.goodput
    _set(goodput_ratio, labels, gp.effective_ratio if gp else None)
    for p in PHASES:
        lost.labels(*labels, p).set(getattr(gp.lost_seconds, p) if gp else 0.0)
        for kind, name in RESTART_FIELDS.items():
            lost_by_restart.labels(*labels, kind, p).set(getattr(getattr(gp.by_restart, name), p) if gp else 0.0)
    _set(step, labels, status.step)
    if status.current.last_step_time:  # cleared at a new attempt's start; keep the previous value until then
        last_step_time.labels(*labels).set(status.current.last_step_time)
    _set(tokens_per_second, labels, status.tokens_per_second)
    _set(loss, labels, status.loss)
    _set(eval_perplexity, labels, status.eval_perplexity)
    ck = status.last_checkpoint
    _set(checkpoint_step, labels, ck.step if ck else None)
    _set(checkpoint_time, labels, ck.time if ck else None)
    checkpoint_save_failures.labels(*labels).set(status.checkpoint_save_failures)
    _set(created_time, labels, status.created_time)
    quarantined.labels(*labels).set(len(status.quarantined_nodes))
    stragglers.labels(*labels).set(sum(s.flagged_time is not None for s in status.current.stragglers))
    if spec is not None:
        _set(checkpoint_interval, labels, expected_checkpoint_interval(spec, status.step_seconds))
        _set(hang_timeout_seconds, labels, hang_timeout(spec, status.step_seconds))


def observe_failure(failure: FailureRecord) -> None:
    """A failure newly recorded in status.failures (once per record: reconcile's effect)."""
    if failure.detected_after is not None:
        detection.labels(failure.cause).observe(failure.detected_after)


def observe_recovery(failure: FailureRecord) -> None:
    """A failure whose new gang is now all Running (once per record)."""
    if failure.recovered_after is not None:
        recovery.labels(failure.cause).observe(failure.recovered_after)


def count_error(namespace: str, run: str) -> None:
    reconcile_errors.labels(namespace, run).inc()


def forget(namespace: str, run: str) -> None:
    """Drop a deleted run's series, so dashboards and alerts do not keep a ghost."""
    labels = (namespace, run)
    for gauge, extra in ((phase, PHASE_NAMES), (restarts, CAUSES), (lost, PHASES)):
        for value in extra:
            with suppress(KeyError):
                gauge.remove(*labels, value)
    for kind in RESTART_FIELDS:
        for p in PHASES:
            with suppress(KeyError):
                lost_by_restart.remove(*labels, kind, p)
    for gauge in _SINGLE + (reconcile_errors,):
        _set(gauge, labels, None)
