"""A command trainer's checkpoint store, seen from its pod (trainer.pod.watch).

The operator runs in its own pod, without the trainer pods' volumes (FSx, EFS) or their IAM
role (S3 through IRSA or Pod Identity), so the pods are the ones that read the store. The
watch around an unmodified script on node rank 0 lists it: once before the script starts (the
resume point: an NxD Training script is pinned to the newest complete tag, its start step is
known; a transient error is retried as every store read at start is, trainer.store.errors),
then once per progress interval (at least MIN_REFRESH_SECONDS), and a last time when the
script exits (a save made just before the exit is reported). Each listing is one listing of
the store's root plus the tags that changed (trainium_api.checkpoints.StoreView). What it
finds, or why it could not list, goes into the pod's progress report
(trainium_api.progress.StoreReport).

The other pods do not list: one decision for the gang (:func:`await_leader`). They read node
rank 0's report of this attempt from its pod (the trainer's Role allows get of the attempt's
pods) and take the checkpoint it chose, so every rank of an NxD Training gang is pinned to the
same tag even where a file system's directory cache shows the pods different listings, and a
gang of 1,000 pods lists its store once, not 1,000 times. No script can save before every
pod has read it: its ranks rendezvous first. A pod that cannot read node rank 0's word (no API
server, outside the operator) lists the store itself. No torch.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

from trainium_api import keys
from trainium_api.checkpoints import StoreView, TagInfo
from trainium_api.progress import CheckpointSeen, ProgressReport, StoreReport

from ..store import errors as store_errors

log = logging.getLogger(__name__)

REFRESH_SECONDS = 10.0  # the default between two listings (trainer.pod.watch passes its progress interval)
MIN_REFRESH_SECONDS = 1.0
FINAL_LIST_SECONDS = 30.0  # the longest the last listing, at the script's exit, holds the pod

# NxD Training resumes from the newest *.ckpt by modification time without checking that it is
# complete; these Hydra overrides pin the newest complete one, or start fresh when there is none.
NXDT_RESUME_FROM = "exp_manager.resume_from_checkpoint"
NXDT_RESUME_IF_EXISTS = "exp_manager.resume_if_exists"


LEADER_WAIT_SECONDS = 600.0  # how long a pod waits for node rank 0's choice (its listing retries for up to 300 s)
LEADER_POLL_SECONDS = 0.5
_POD_OF_ATTEMPT = re.compile(r"^(?P<gang>.+-a\d+)-(?P<index>\d+)$")  # <run>-a<attempt>-<index> (plan.pod_name)


def resume_arguments(layout: str, uri: str, chosen: CheckpointSeen | None) -> list[str]:
    """Arguments appended to a command trainer's command so that it resumes safely from
    ``chosen`` (a tag of the store at ``uri``)."""
    if layout != "nxdt":
        return []  # our trainer and NxD's load_checkpoint(tag=None) only ever take a tag with `done`
    if chosen is not None:
        # quoted: the tag name has '=' in it, which Hydra's override grammar only takes quoted
        return [f'{NXDT_RESUME_FROM}="{uri.rstrip("/")}/{chosen.tag}"']
    return [f"{NXDT_RESUME_IF_EXISTS}=false"]


def seen(tag: TagInfo | None) -> CheckpointSeen | None:
    return None if tag is None else CheckpointSeen(tag.tag, tag.step, tag.done_mtime)


def leader_pod(pod: str) -> str | None:
    """The name of node rank 0's pod of the same attempt, None for a name not of that form."""
    m = _POD_OF_ATTEMPT.match(pod or "")
    return f"{m.group('gang')}-0" if m else None


def await_leader(api, namespace: str, pod: str, attempt: int, timeout: float = LEADER_WAIT_SECONDS,
                 poll: float = LEADER_POLL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[bool, CheckpointSeen | None]:
    """(answered, the checkpoint node rank 0 chose) from its pod's progress report of
    ``attempt``: its store report names the tag (none: it found no complete checkpoint).
    (False, None) when it does not answer within ``timeout`` (the caller lists itself)."""
    deadline = clock() + timeout
    while clock() < deadline:
        try:
            obj = api.read_namespaced_pod(pod, namespace, _request_timeout=10)
            annotations = (obj.metadata.annotations or {}) if obj.metadata else {}
            said, _ = ProgressReport.parse(annotations.get(keys.PROGRESS))
        except Exception as exc:  # noqa: BLE001 - not there yet, or the API server is away: ask again
            log.debug("waiting for %s's checkpoint choice: %s", pod, exc)
            said = None
        if said is not None and said.attempt == attempt and said.start_step is not None:
            return True, said.store.checkpoint
        sleep(poll)
    return False, None


class StoreWatch:
    """Lists the store and hands each change of what it sees to ``on_change`` (a StoreReport)."""

    def __init__(self, uri: str, layout: str, on_change: Callable[[StoreReport], None],
                 refresh_seconds: float = REFRESH_SECONDS, sleep: Callable[[float], None] = time.sleep):
        self.view = StoreView(uri, layout)
        self.on_change, self.refresh_seconds, self._sleep = on_change, refresh_seconds, sleep
        self.report = StoreReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one listing at a time (the final one may meet the loop's)

    def list_once(self) -> TagInfo | None:
        """One listing; its result (or its error) is reported. Raises what the listing raised."""
        with self._lock:
            try:
                newest = self.view.newest()
            except Exception as exc:
                self._publish(StoreReport(self.report.checkpoint, f"cannot list {self.view.root}: "
                                                                   f"{type(exc).__name__}: {exc}"))
                raise
            self._publish(StoreReport(seen(newest)))
            return newest

    def at_start(self, policy: store_errors.Backoff | None = None) -> TagInfo | None:
        """The newest complete tag before the script starts. A transient error is retried
        (store_errors.retry: jittered backoff; each failure is reported as it happens); one that
        lasts raises StoreUnavailable (exit 75), a persistent refusal StoreConfigError."""
        return store_errors.retry(self.list_once, f"list the checkpoint store {self.view.root}", policy,
                                  sleep=self._sleep)

    def start(self) -> None:
        """Lists every refresh_seconds in the background until stop()."""
        self._thread = threading.Thread(target=self._loop, name="store-watch", daemon=True)
        self._thread.start()

    def stop(self, final: bool = True) -> None:
        """Stops the background listing; ``final``: list once more (a save made at the exit),
        waiting at most FINAL_LIST_SECONDS: a store that hangs must not keep the pod from ending."""
        self._stop.set()
        if final:
            last = threading.Thread(target=self._list_logged, name="store-watch-final", daemon=True)
            last.start()
            last.join(FINAL_LIST_SECONDS)

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            self._list_logged()

    def _list_logged(self) -> None:
        try:
            self.list_once()
        except Exception as exc:  # said in the report; listed again at the next refresh
            log.warning("cannot list the checkpoint store %s: %s", self.view.root, exc)

    def _publish(self, report: StoreReport) -> None:
        if report != self.report:
            self.report = report
            self.on_change(report)
