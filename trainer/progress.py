"""The progress annotation (docs/architecture.md 3.2): how the operator learns step, speed and hangs.

Local rank 0 of every pod patches its own pod's annotation ``trainium.dev/progress`` with
``{"step", "time", "tokensPerSecond", "loss", "lastCheckpointStep", "startStep", "evalPerplexity"}``
(``time``: when that step ended; ``startStep``: the step this process resumed at, 0 on a fresh
start; ``evalPerplexity``: the newest held-out perplexity, null without data.heldOut) at most once per
``logging.progressIntervalSeconds``, from a background thread so a slow API server never slows
a step. It is on when the pod knows its name (``POD_NAME``, ``POD_NAMESPACE`` from the downward
API) and can reach the API server (in-cluster service account, or ``KUBECONFIG``); otherwise
off. No torch here: the operator parses the same payload with :func:`parse`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

log = logging.getLogger(__name__)

ANNOTATION = "trainium.dev/progress"
# A patch the API server holds (etcd away) gives up after this long, so one stuck call cannot
# silence the reports that follow it.
REQUEST_TIMEOUT_SECONDS = 10.0
RETRY_SECONDS = 1.0  # the least pause before a failed report is sent again
FIELDS = ("step", "time", "tokensPerSecond", "loss", "lastCheckpointStep", "startStep", "evalPerplexity")


def _rounded(value: float | None, digits: int) -> float | None:
    """None for unknown or non-finite values (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, digits)


def payload(step: int, tokens_per_second: float | None, loss: float | None, last_checkpoint_step: int | None,
            now: float | None = None, start_step: int = 0, eval_perplexity: float | None = None) -> str:
    """``tokens_per_second`` and ``loss`` may be None where the writer cannot know them (a
    script whose log has no throughput); the operator then leaves them out of the status."""
    return json.dumps({"step": step, "time": round(now if now is not None else time.time(), 3),
                       "tokensPerSecond": _rounded(tokens_per_second, 2), "loss": _rounded(loss, 5),
                       "lastCheckpointStep": last_checkpoint_step, "startStep": start_step,
                       "evalPerplexity": _rounded(eval_perplexity, 4)},
                      separators=(",", ":"))


# What each field may hold. The annotation is written by user code (a command trainer's log
# is parsed by trainer.watch, and anything in the pod can patch it), so the operator checks every
# field for type and range and drops one that does not fit rather than compute with it.
_STEP = (int, 0, 2 ** 53)
_LIMITS: dict[str, tuple[type, float, float]] = {
    "step": _STEP, "time": (float, 0.0, 1e11), "tokensPerSecond": (float, 0.0, 1e15),
    "loss": (float, -1e9, 1e9), "lastCheckpointStep": _STEP, "startStep": _STEP, "evalPerplexity": (float, 0.0, 1e30)}
MAX_LENGTH = 4096  # a report is about 150 bytes; a larger annotation is not parsed at all


def parse(text: str | None) -> dict | None:
    """The operator's side: a progress dict, or None when absent or malformed."""
    return parse_report(text)[0]


def parse_report(text: str | None) -> tuple[dict | None, list[str]]:
    """The progress dict (every field of FIELDS; one that does not fit its type and range is
    None) and what was wrong, field by field. No report (None) without a valid ``step``. Never
    raises."""
    if not text:
        return None, []
    if len(text) > MAX_LENGTH:
        return None, [f"longer than {MAX_LENGTH} characters"]
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None, ["not JSON"]
    if not isinstance(data, dict):
        return None, ["not a JSON object"]
    out, errors = {}, []
    for key in FIELDS:
        value, why = _checked(key, data.get(key))
        out[key] = value
        if why:
            errors.append(f"{key}: {why}")
    return (out if out["step"] is not None else None), errors


def _checked(key: str, value) -> tuple[int | float | None, str]:
    kind, low, high = _LIMITS[key]
    if value is None:
        return None, "missing" if key == "step" else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return None, f"must be {'an integer' if kind is int else 'a number'}, got {str(value)[:40]!r}"
    if not (low <= value <= high):  # NaN fails this too
        return None, f"{value!r} is out of range [{low:g}, {high:g}]"
    return kind(value), ""


class ProgressReporter:
    """Rate-limited, non-blocking annotation writer. ``report`` never raises."""

    def __init__(self, interval_seconds: float, pod: str | None = None, namespace: str | None = None):
        self.interval = interval_seconds
        self.pod = pod or os.environ.get("POD_NAME")
        self.namespace = namespace or os.environ.get("POD_NAMESPACE", "default")
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
        try:
            from kubernetes import client, config
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            elif os.environ.get("KUBECONFIG"):
                # named here: the client read $KUBECONFIG when it was imported, maybe before it was set
                config.load_kube_config(config_file=os.environ["KUBECONFIG"])
            else:
                return None
            return client.CoreV1Api()
        except Exception as exc:
            log.warning("progress annotation off: cannot reach the API server (%s)", exc)
            return None

    def report(self, step: int, tokens_per_second: float | None, loss: float | None, last_checkpoint_step: int | None,
               force: bool = False, step_time: float | None = None, start_step: int = 0,
               eval_perplexity: float | None = None) -> None:
        """``step_time``: when the step ended (epoch seconds; default now). The operator measures
        lost time from it, so it is the step's time, not the time the report is sent."""
        if not self.enabled:
            return
        self._latest = payload(step, tokens_per_second, loss, last_checkpoint_step, now=step_time,
                               start_step=start_step, eval_perplexity=eval_perplexity)
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
        self._api.patch_namespaced_pod(self.pod, self.namespace, {"metadata": {"annotations": {ANNOTATION: body}}},
                                       _request_timeout=REQUEST_TIMEOUT_SECONDS)

    def close(self, timeout: float = 5.0) -> None:
        """Flush the latest payload and stop."""
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._latest is not None:
            try:
                self._send(self._latest)
                self.sent += 1
            except Exception as exc:
                log.warning("final progress annotation failed: %s", exc)
