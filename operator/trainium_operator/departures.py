"""The last look at each run's pods on their way out, for the judge's vanished rule.

A pod evicted through the API (a drain, Karpenter) is marked DisruptionTarget, deleted with a
grace period, and gone once its container exits: on a fast kubelet, within tens of
milliseconds. kopf's index drops it at its DELETED event, so a pass that begins after that sees
only a gang short of a pod, and could not tell a drain (voluntary, no budget spent) from
someone deleting the pod. The watcher therefore keeps the last view of every pod seen deleting
or deleted, for ``KEEP_SECONDS``, and each pass hands the ones of its run to the judge
(judge.find_failure's ``departed``).
"""

from __future__ import annotations

import threading
import time

from .observe import PodView

KEEP_SECONDS = 120.0
"""How long a departed pod's last view is kept: far longer than a pass takes to notice it."""


class Departures:
    """Per run, the last view of each pod seen deleting or deleted. Written from kopf's event
    loop, read by the passes' threads: a lock guards it."""

    def __init__(self, keep: float = KEEP_SECONDS) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], dict[str, tuple[float, PodView]]] = {}

    def note(self, namespace: str, run: str, view: PodView, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            pods = self._runs.setdefault((namespace, run), {})
            pods[view.name] = (now, view)
            for name in [n for n, (at, _) in pods.items() if now - at > self.keep]:
                del pods[name]

    def drop(self, namespace: str, run: str, name: str) -> None:
        with self._lock:
            pods = self._runs.get((namespace, run))
            if pods and pods.pop(name, None) is not None and not pods:
                del self._runs[(namespace, run)]

    def of(self, namespace: str, run: str, now: float | None = None) -> list[PodView]:
        """The run's pods that departed within ``keep`` seconds, their last view each."""
        now = time.monotonic() if now is None else now
        with self._lock:
            pods = self._runs.get((namespace, run)) or {}
            return [view for at, view in pods.values() if now - at <= self.keep]

    def forget(self, namespace: str, run: str) -> None:
        with self._lock:
            self._runs.pop((namespace, run), None)
