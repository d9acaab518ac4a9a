"""The operator's Prometheus series (served on /metrics by prometheus-client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .goodput import PHASES

REGISTRY = CollectorRegistry()
RUN = ["namespace", "run"]
PHASE_NAMES = ("Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended")

phase = Gauge("trainium_run_phase", "1 for the run's current phase", RUN + ["phase"], registry=REGISTRY)
restarts = Counter("trainium_run_restarts", "Gang restarts by cause", RUN + ["cause"], registry=REGISTRY)
detection = Histogram("trainium_failure_detection_seconds", "Failure signal to detection", ["cause"],
                      buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=REGISTRY)
recovery = Histogram("trainium_failure_recovery_seconds", "Detection to the new gang running", ["cause"],
                     buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800), registry=REGISTRY)
goodput_ratio = Gauge("trainium_run_effective_training_ratio", "Productive / wall time", RUN, registry=REGISTRY)
lost = Gauge("trainium_run_lost_seconds", "Lost time by phase", RUN + ["phase"], registry=REGISTRY)
step = Gauge("trainium_run_step", "Newest step reported by the gang", RUN, registry=REGISTRY)
tokens_per_second = Gauge("trainium_run_tokens_per_second", "Tokens per second of the gang", RUN, registry=REGISTRY)
checkpoint_step = Gauge("trainium_run_last_checkpoint_step", "Step of the newest complete checkpoint", RUN,
                        registry=REGISTRY)
checkpoint_time = Gauge("trainium_run_last_checkpoint_timestamp_seconds", "When it was written", RUN,
                        registry=REGISTRY)
quarantined = Gauge("trainium_run_quarantined_nodes", "Nodes quarantined by the run", RUN, registry=REGISTRY)
reconcile_errors = Counter("trainium_reconcile_errors", "Reconcile passes that raised", RUN, registry=REGISTRY)
reconcile_seconds = Histogram("trainium_reconcile_seconds", "Duration of one reconcile pass",
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=REGISTRY)


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)


def observe_status(namespace: str, run: str, status: dict, new_failure: dict | None) -> None:
    labels = (namespace, run)
    for p in PHASE_NAMES:
        phase.labels(*labels, p).set(1 if status.get("phase") == p else 0)
    if status.get("step") is not None:
        step.labels(*labels).set(status["step"])
    if status.get("tokensPerSecond") is not None:
        tokens_per_second.labels(*labels).set(status["tokensPerSecond"])
    gp = status.get("goodput") or {}
    if gp.get("effectiveRatio") is not None:
        goodput_ratio.labels(*labels).set(gp["effectiveRatio"])
    for p in PHASES:
        lost.labels(*labels, p).set((gp.get("lostSeconds") or {}).get(p, 0.0))
    ck = status.get("lastCheckpoint") or {}
    if ck.get("step") is not None:
        checkpoint_step.labels(*labels).set(ck["step"])
        if ck.get("time"):
            checkpoint_time.labels(*labels).set(ck["time"])
    quarantined.labels(*labels).set(len(status.get("quarantinedNodes") or []))
    if new_failure:
        if new_failure.get("action") == "restart":
            restarts.labels(*labels, new_failure["cause"]).inc()
        if new_failure.get("detectedAfter") is not None:
            detection.labels(new_failure["cause"]).observe(new_failure["detectedAfter"])


def observe_recovery(cause: str, seconds: float) -> None:
    recovery.labels(cause).observe(seconds)
