"""Each run's newest complete checkpoint, listed in the background (CheckpointLister).

The operator lists a run's checkpoint store to tell a new gang where to resume; a store can be
slow or hang, so listing never happens on a reconcile pass: a pass takes the newest answer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from trainium_api import checkpoints as checkpoint_store
from trainium_api.fields import ConfigError
from trainium_api.status import TERMINAL, CheckpointRef

from .spec import check_checkpoint_uri, checkpoint_layout

log = logging.getLogger("trainium_operator")
CHECKPOINT_REFRESH_SECONDS = 15.0
# While a gang is about to start, the checkpoint it is told to resume from must be current.
CHECKPOINT_REFRESH_STARTING_SECONDS = 1.0
# the longest a pass waits for a listing under way when a gang is about to start or a pod succeeded
CHECKPOINT_WAIT_SECONDS = 0.5
STARTING_PHASES = (None, "Restarting", "Suspended")  # Suspended: once spec.suspend is cleared


class CheckpointLister:
    """Each run's newest complete checkpoint, listed off the reconcile pass: a pass takes the
    newest answer at once and, when one is due, starts a listing in the background (one per
    run at a time, on LIST_WORKERS threads), so a slow or hung store never holds a pass.

    Due: every CHECKPOINT_REFRESH_SECONDS, every CHECKPOINT_REFRESH_STARTING_SECONDS while a new
    gang is about to start (it is told where to resume, a resumed suspension included), or
    after REPORTED_REFRESH_SECONDS when a pod reports a newer checkpoint step. A finished run is
    not listed, but for its final listing: when the operator first sees a pod succeed (its own
    clock: no kubelet's timestamp is compared with it), one listing begun after that moment
    must answer (or fail FINAL_TRIES times, or be given up) before the run stops being listed, so that the save a
    trainer made just before it exited is the checkpoint the run reports, even when a listing
    begun earlier was still under way or the store answers after the run turned Succeeded. A listing that
    fails keeps the last answer; one that has run for LIST_TIMEOUT_SECONDS without answering is
    given up (its result is dropped), and the run's store is not asked again until that call
    returns, so a hung store holds one worker."""

    LIST_WORKERS = 16
    FINAL_TRIES = 3  # a finished run's final listing is tried this many times when the store fails
    LIST_TIMEOUT_SECONDS = 30.0
    REPORTED_REFRESH_SECONDS = 5.0
    """A pod reporting a newer checkpoint step than listed makes a listing due sooner, but not
    more often than this: a trainer reporting a step the store never shows must not list every pass."""

    def __init__(self, list_newest=None, store_check=lambda uri, namespace: None):
        """``store_check(uri, namespace)`` raises ConfigError for a store the operator's
        configuration does not let that namespace name (HostAccess.check_checkpoint_store):
        such a store is never listed, a run accepted before the configuration changed included."""
        self._list = list_newest or checkpoint_store.newest_complete
        self._store_check = store_check
        self._pool = ThreadPoolExecutor(max_workers=self.LIST_WORKERS, thread_name_prefix="checkpoints")
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], dict] = {}
        self._tokens = 0  # one counter for every run: a late listing never lands in a re-created run

    def newest(self, run: dict, phase: str | None, pods) -> CheckpointRef | None:
        ckpt = run["spec"].get("checkpoint")
        uri = ckpt.get("uri") if isinstance(ckpt, dict) else None
        if not uri or not isinstance(uri, str):
            return None  # nothing to resume
        key = (run["metadata"]["namespace"], run["metadata"]["name"])
        if phase in TERMINAL:
            with self._lock:
                entry = self._entries.get(key)
                if entry is None or not self._final_pending(entry):
                    return None  # a finished run is not listed again, once its final listing answered
        try:  # the raw spec, read before the pass parses it: never list what the spec check refuses
            check_checkpoint_uri(uri)
            self._store_check(uri, run["metadata"]["namespace"])
        except ConfigError:
            return None
        reported = max((p.progress.get("lastCheckpointStep") or -1 for p in pods if p.progress), default=-1)
        starting = phase in STARTING_PHASES and not (phase == "Suspended" and run["spec"].get("suspend"))
        refresh = CHECKPOINT_REFRESH_STARTING_SECONDS if starting else CHECKPOINT_REFRESH_SECONDS
        # a pod is the same pod while its name and creation time are (a re-created gang's are new)
        succeeded = {(getattr(p, "name", None), getattr(p, "created", None)) for p in pods
                     if getattr(p, "phase", None) == "Succeeded"}
        now = time.monotonic()
        with self._lock:
            if phase in TERMINAL:  # again, under this lock: a forget() may have come in between
                entry = self._entries.get(key)
                if entry is None or not self._final_pending(entry):
                    return None
            # answered: when the newest listing that answered, failed or was given up was submitted
            entry = self._entries.setdefault(key, {"at": -1e9, "step": None, "value": None, "job": None,
                                                   "token": 0, "succeeded": set(), "success_seen": None,
                                                   "answered": -1e9, "final_failures": 0})
            if succeeded - entry["succeeded"]:  # a pod succeeded since the last pass: the run may end
                entry["succeeded"] |= succeeded
                entry["success_seen"], entry["final_failures"] = now, 0
            ending = self._final_pending(entry)
            job = entry["job"]
            started = getattr(job, "running_since", None) if job is not None else None
            if job is not None and not job.done() and started is not None and \
                    now - started > self.LIST_TIMEOUT_SECONDS:
                log.warning("listing checkpoints in %s has not answered in %.0fs: given up", uri,
                            self.LIST_TIMEOUT_SECONDS)
                entry["hung"], entry["job"] = job, None  # its result is dropped
                entry["answered"] = entry["at"]  # a listing given up counts as answered
                job = None
            hung = entry.get("hung")
            if hung is not None and hung.done():
                hung = entry["hung"] = None
            newer = reported > (entry["step"] if entry["step"] is not None else -1)
            periodic = phase not in TERMINAL and \
                now - entry["at"] > (min(refresh, self.REPORTED_REFRESH_SECONDS) if newer else refresh)
            final = ending and entry["at"] < entry["success_seen"]  # none submitted since the success
            wait = starting
            if (periodic or final) and job is None and hung is None:  # a hung store holds one worker, not more
                wait = starting or final  # once per success: a store that hangs holds no pass again
                entry["at"] = now  # a failing store is asked again at the next refresh, not every pass
                self._tokens += 1
                entry["token"] = self._tokens
                job = entry["job"] = self._pool.submit(self._list_one, key, entry["token"], now, uri,
                                                       checkpoint_layout(run["spec"]))
            value = entry["value"]
        if job is not None and wait:
            # a gang about to start is told where to resume, and a run about to end reports its
            # final checkpoint: wait briefly for a listing under way (a fast store answers in
            # milliseconds; a slow one does not hold the pass: a later pass takes its answer)
            with contextlib.suppress(Exception):
                job.result(timeout=CHECKPOINT_WAIT_SECONDS)
            value = self._entries.get(key, {}).get("value")
        return value

    @staticmethod
    def _final_pending(entry: dict) -> bool:
        """A pod succeeded and no listing submitted since has answered, failed or been given up."""
        return entry["success_seen"] is not None and entry["answered"] < entry["success_seen"]

    def _list_one(self, key: tuple[str, str], token: int, submitted: float, uri: str, layout: str) -> None:
        with self._lock:  # the age of a listing counts from when it runs, not from its queueing
            entry = self._entries.get(key)
            if entry is None or entry["token"] != token:
                return
            if entry["job"] is not None:
                entry["job"].running_since = time.monotonic()
        try:
            tag = self._list(uri, layout)
        except Exception as exc:  # the store may be briefly unreachable: keep the last answer
            log.warning("cannot list checkpoints in %s: %s", uri, exc)
            tag, failed = None, True
        else:
            failed = False
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry["job"] is None or entry["token"] != token:
                return  # forgotten, given up, or overtaken: a newer listing decides
            entry["job"] = None
            if not failed:
                entry["value"] = CheckpointRef(tag=tag.tag, step=tag.step, time=tag.done_mtime, uri=tag.uri) \
                    if tag else None
                entry["step"] = tag.step if tag else None
            elif self._final_pending(entry) and submitted >= entry["success_seen"]:
                entry["final_failures"] += 1  # a final listing that failed: asked again at the next pass,
                if entry["final_failures"] < self.FINAL_TRIES:  # a few times (one 5xx must not lose it)
                    entry["at"] = -1e9
                    return
            entry["answered"] = submitted

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._entries.pop((namespace, name), None)
