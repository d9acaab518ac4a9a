"""The progress annotation's writer (docs/architecture.md 3.2); its schema is trainium_api.progress.

Local rank 0 of every pod patches its own pod's annotation (trainium_api.keys.PROGRESS,
a trainium_api.progress.ProgressReport) at most once per ``logging.progressIntervalSeconds``,
from a background thread so a slow API server never slows a step. It is on when the pod knows
its name (``POD_NAME``, ``POD_NAMESPACE`` from the downward API) and can reach the API server
(in-cluster service account, or ``KUBECONFIG``); otherwise off. No torch here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from trainium_api import keys
from trainium_api.progress import ProgressReport

from .podenv import PodEnv

log = logging.getLogger(__name__)

# A patch the API server holds (etcd away) gives up after this long, so one stuck call cannot
# silence the reports that follow it.
REQUEST_TIMEOUT_SECONDS = 10.0
RETRY_SECONDS = 1.0  # the least pause before a failed report is sent again
FINAL_TRIES = 3  # the last report at exit (1 s, then 2 s apart)


def connect_api(env: PodEnv | None = None):
    """A CoreV1Api as the pod's own identity (in cluster) or $KUBECONFIG's; None outside both
    or when the API server cannot be reached (reports are then off, never an error)."""
    env = env or PodEnv.from_environ()
    try:
        from kubernetes import client, config
        if env.kubernetes_service_host:
            config.load_incluster_config()
        elif env.kubeconfig:
            # named here: the client read $KUBECONFIG when it was imported, maybe before it was set
            config.load_kube_config(config_file=env.kubeconfig)
        else:
            return None
        return client.CoreV1Api()
    except Exception as exc:
        log.warning("progress annotation off: cannot reach the API server (%s)", exc)
        return None


def annotate_own_pod(key: str, value: str, after: threading.Thread | None = None,
                     env: PodEnv | None = None) -> threading.Thread | None:
    """Set one annotation on this pod ($POD_NAME), once, from a daemon thread: the caller never
    waits for the API server (an unreachable one would hold it for the client's retries). A
    failure is logged, never raised: it costs only what the run's status shows. ``after``: an
    earlier write of the same key, waited for first, so the writes land in order. Returns the
    thread, None outside a pod."""
    env = env or PodEnv.from_environ()
    pod = env.pod_name
    if not pod:
        return None

    def write() -> None:
        if after is not None:
            after.join()
        api = connect_api(env)
        if api is None:
            return
        try:
            api.patch_namespaced_pod(pod, env.pod_namespace,
                                     {"metadata": {"annotations": {key: value}}},
                                     _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except Exception as exc:
            log.warning("could not set %s on pod %s: %s", key, pod, exc)
    thread = threading.Thread(target=write, name=f"annotate {key}", daemon=True)
    thread.start()
    return thread


class ProgressReporter:
    """Rate-limited, non-blocking annotation writer. ``report`` never raises."""

    def __init__(self, interval_seconds: float, pod: str | None = None, namespace: str | None = None,
                 env: PodEnv | None = None):
        self.env = env = env or PodEnv.from_environ()
        self.interval = interval_seconds
        self.pod = pod or env.pod_name
        self.namespace = namespace or env.pod_namespace
        self._api = None
        self._latest: str | None = None
        self._unsent = False  # _latest is newer than what the pod carries
        self._force = False
        self._sent_at = 0.0
        self._retry_at = 0.0  # monotonic time before which a failed report is not sent again
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        if self.pod:
            self._api = self._connect()
        if self._api is not None:
            self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._api is not None

    def _connect(self):
        return connect_api(self.env)

    def report(self, report: ProgressReport, force: bool = False) -> None:
        """``report.time``: when the step ended (epoch seconds; None: now). The operator measures
        lost time from it, so it is the step's time, not the time the report is sent;
        ``first_step_time`` likewise for this process's first step. ``report.store``: what this
        pod sees of its checkpoint store (the operator cannot read it); ``step`` None: no step
        yet, the store alone is reported. Its ``attempt`` is this process's (ATTEMPT)."""
        if not self.enabled:
            return
        self._latest = dataclasses.replace(report, time=report.time if report.time is not None else time.time(),
                                           attempt=self.env.attempt_number).to_annotation()
        self._unsent = True
        self._force = self._force or force
        self._wake.set()  # the sender decides when: now if forced, else once the interval has passed

    def _loop(self) -> None:
        while not self._stop:
            # a report held back by the rate limit goes out once the interval has passed, so a
            # writer that reports rarely (a script logging every N steps) is never a step behind
            wait = None
            if self._unsent:
                now = time.monotonic()
                wait = 0.0 if self._force else max(0.0, self.interval - (now - self._sent_at))
                wait = max(wait, self._retry_at - now)
            self._wake.wait(wait)
            self._wake.clear()
            body = self._latest
            if self._stop or body is None or not self._unsent:
                continue
            now = time.monotonic()
            if (not self._force and now - self._sent_at < self.interval) or now < self._retry_at:
                continue
            self._unsent = self._force = False
            self._sent_at = now
            try:
                self._send(body)
                self.sent += 1
            except Exception as exc:
                # sent again (or a newer one) after a pause, not only at the next step: a trainer
                # with minute-long steps must not look hung after an API outage
                pause = max(self.interval, RETRY_SECONDS)
                self._unsent, self._retry_at = True, time.monotonic() + pause
                log.warning("progress annotation failed (retrying in %.0fs): %s", pause, exc)

    def _send(self, body: str) -> None:
        self._api.patch_namespaced_pod(self.pod, self.namespace, {"metadata": {"annotations": {keys.PROGRESS: body}}},
                                       _request_timeout=REQUEST_TIMEOUT_SECONDS)

    def close(self, timeout: float = 5.0) -> None:
        """Flush the latest payload and stop."""
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._latest is None:
            return
        # the last report carries what the run ends with (its final checkpoint): one 429 or 5xx,
        # likely when a thousand pods finish together, must not lose it; tried FINAL_TRIES times
        for attempt in range(FINAL_TRIES):
            try:
                self._send(self._latest)
                self.sent += 1
                return
            except Exception as exc:
                log.warning("final progress annotation failed (try %d of %d): %s", attempt + 1, FINAL_TRIES, exc)
                if attempt + 1 < FINAL_TRIES:
                    time.sleep(RETRY_SECONDS * (attempt + 1))
