"""TensorBoard scalars of a run (``logging.tensorboard``), written by rank 0.

Event files are TensorBoard's own format, written by PyTorch's ``SummaryWriter`` (the
``tensorboard`` package's writer). A local directory is written in place. Any other fsspec URL
(``s3://...``) is written through a local staging folder: every 5 minutes, and at a checkpoint
(at most every 30 s), the open event file is closed and a background thread uploads the closed
files, oldest first, so a slow or failing store never stalls a step. TensorBoard reads every event
file in a folder as one stream, in name order. A file that fails to upload stays staged, and it
and the files after it are tried again at the next roll and at the end; the staging folder is the
same for every process of the run in a container (it is named after the URL), so a process
started after a crash in the same container (an in-place restart) uploads what the last one
left.

Logging never stops training: a writer that cannot be opened or written (a full disk, a
read-only volume, the ``tensorboard`` package missing from the image) is reported once and
turned off. The end waits for the last upload at most ``CLOSE_SECONDS``.

A process that resumed at step N opens its first file with ``purge_step=N+1``: TensorBoard then
drops the earlier attempt's events from that step on, so the steps trained again after a fault
are shown once, as trained the second time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

# The scalars' tags (TensorBoard groups them by the part before "/").
LOSS = "train/loss"
LEARNING_RATE = "train/learning_rate"
GRAD_NORM = "train/grad_norm"
TOKENS_PER_SECOND = "train/tokens_per_second"
MFU = "train/mfu"
STEP_SECONDS = "train/step_seconds"
EVAL_LOSS = "eval/loss"
EVAL_PERPLEXITY = "eval/perplexity"

# A remote store gets a closed event file this often, and at a checkpoint at most every
# PERSIST_SECONDS: a few hundred small objects a day for TensorBoard to read, not thousands.
ROLL_SECONDS = 300.0
PERSIST_SECONDS = 30.0
FLUSH_SECONDS = 30  # the writer's own flush of its open file
CLOSE_SECONDS = 30.0  # how long the end waits for the last upload


def staging_folder(uri: str) -> str:
    """Where a remote URL's events wait for upload: one folder per URL in this container."""
    return os.path.join(tempfile.gettempdir(), "trainium-tensorboard-" + hashlib.sha256(uri.encode()).hexdigest()[:12])


class ScalarLog:
    def __init__(self, uri: str, first_step: int, roll_seconds: float = ROLL_SECONDS):
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package: only when asked for
        self._writer_class = SummaryWriter
        self.fs, path = fsspec.core.url_to_fs(uri)
        self.path = path.rstrip("/") or path
        self.remote = not isinstance(self.fs, LocalFileSystem)
        self.staging = staging_folder(uri) if self.remote else self.path
        os.makedirs(self.staging, exist_ok=True)
        self.roll_seconds = roll_seconds
        self.rolled_at = time.monotonic()
        self.first_step: int | None = first_step  # purge_step of this process's first file
        self.writer = None
        self.dirty = False  # something was logged since the last roll
        self.broken = False  # a write failed: logging is off for this process
        self._warned = False
        self._jobs: queue.Queue = queue.Queue()
        self._backlog: list[str] = []  # staged closed files not yet uploaded, oldest first (the uploader's)
        if self.remote:
            threading.Thread(target=self._uploader, name="tensorboard-upload", daemon=True).start()
            self._jobs.put((self._closed(), None))  # what a process before this one in the container left
        self._open()

    def _open(self) -> None:
        purge = {"purge_step": self.first_step} if self.first_step is not None else {}
        self.writer = self._writer_class(self.staging, flush_secs=FLUSH_SECONDS, **purge)
        self.first_step = None

    def _failed(self, what: str, exc: BaseException) -> None:
        """Logging goes off for this process; training goes on."""
        self.broken = True
        log.error("TensorBoard logging to %s stopped (%s: %s: %s); training goes on", self.path, what,
                  type(exc).__name__, exc)

    def scalars(self, step: int, values: dict[str, float | None], walltime: float | None = None) -> None:
        """Record ``values`` (tag -> value; None is left out) at ``step``."""
        if self.broken:
            return
        try:
            if self.writer is None:
                self._open()
            for tag, value in values.items():
                if value is not None:
                    self.writer.add_scalar(tag, value, step, walltime=walltime)
            self.dirty = True
            if self.remote and time.monotonic() - self.rolled_at >= self.roll_seconds:
                self._roll()
        except Exception as exc:  # a full disk, a read-only volume: never the run's end
            self._failed("writing", exc)

    def persist(self) -> None:
        """At a checkpoint: what was logged goes on its way to the store (flushed, for a local
        folder), unless a file went up less than PERSIST_SECONDS ago."""
        if self.broken or not self.dirty:
            return
        try:
            if not self.remote:
                self.writer.flush()
            elif time.monotonic() - self.rolled_at >= PERSIST_SECONDS:
                self._roll()
        except Exception as exc:
            self._failed("flushing", exc)

    def _closed(self) -> list[str]:
        """The staged files, all closed (called with no writer open: the next write opens one)."""
        return sorted(os.listdir(self.staging))

    def _roll(self) -> None:
        """Close the open file and have every closed one uploaded; the next write opens a new one."""
        self.writer.close()
        self.writer, self.dirty = None, False
        self.rolled_at = time.monotonic()
        self._jobs.put((self._closed(), None))

    def _uploader(self) -> None:
        while True:
            names, done = self._jobs.get()
            try:
                self._backlog = sorted(set(self._backlog) | set(names))
                self._upload()
            except Exception as exc:  # (never the thread's end: later rolls still upload)
                log.warning("TensorBoard upload: %s: %s", type(exc).__name__, exc)
            finally:
                if done is not None:
                    done.set()

    def _upload(self) -> None:
        """Upload the backlog oldest first (TensorBoard reads the files in name order), deleting
        each; the first that fails and those after it stay for the next try."""
        while self._backlog:
            name = self._backlog[0]
            local = os.path.join(self.staging, name)
            if os.path.exists(local):
                try:
                    self.fs.put_file(local, f"{self.path}/{name}")
                except Exception as exc:  # the store's trouble must not end the run: kept, tried again
                    if not self._warned:
                        log.warning("TensorBoard events not uploaded to %s (kept, tried again): %s: %s",
                                    self.path, type(exc).__name__, exc)
                        self._warned = True
                    return
                self._warned = False
                os.remove(local)
            self._backlog.pop(0)

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as exc:
                self._failed("closing", exc)
            self.writer = None
        if not self.remote:
            return
        done = threading.Event()
        self._jobs.put((self._closed(), done))
        if not done.wait(CLOSE_SECONDS):
            log.warning("TensorBoard events still uploading to %s after %.0fs; left in %s (a process "
                        "started in this container uploads them)", self.path, CLOSE_SECONDS, self.staging)
        elif os.listdir(self.staging):
            log.warning("TensorBoard events left in %s: the upload to %s failed", self.staging, self.path)
