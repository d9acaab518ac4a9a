"""TensorBoard scalars of a run (``logging.tensorboard``), written by rank 0.

Event files are TensorBoard's own format, written by PyTorch's ``SummaryWriter`` (the
``tensorboard`` package's writer). A local directory is written in place. Any other fsspec URL
(``s3://...``) is written through a local staging folder: every 5 minutes, and at a checkpoint,
the open event file is closed and a background thread uploads it, so a slow or failing store
never stalls a step. TensorBoard reads every event file in a folder as one stream. A file that fails to upload stays
staged and is tried again at the next roll and at the end.

A process that resumed at step N opens its first file with ``purge_step=N+1``: TensorBoard then
drops the earlier attempt's events from that step on, so the steps trained again after a fault
are shown once, as trained the second time.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

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

# A remote store gets a closed event file this often, and at a checkpoint at most this often: a
# few hundred small objects a day for TensorBoard to read, not thousands.
ROLL_SECONDS = 300.0
PERSIST_SECONDS = 30.0
FLUSH_SECONDS = 30  # the writer's own flush of its open file


class ScalarLog:
    def __init__(self, uri: str, first_step: int, roll_seconds: float = ROLL_SECONDS):
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package: only when asked for
        self._writer_class = SummaryWriter
        self.fs, self.path = fsspec.core.url_to_fs(uri.rstrip("/") or uri)
        self.remote = not isinstance(self.fs, LocalFileSystem)
        if self.remote:
            self.staging = tempfile.mkdtemp(prefix="tensorboard-")
            self.uploads: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="tensorboard-upload")
        else:
            os.makedirs(self.path, exist_ok=True)
            self.staging, self.uploads = self.path, None
        self.roll_seconds = roll_seconds
        self.writer = SummaryWriter(self.staging, purge_step=first_step, flush_secs=FLUSH_SECONDS)
        self.rolled_at = time.monotonic()
        self._warned = False

    def scalars(self, step: int, values: dict[str, float | None], walltime: float | None = None) -> None:
        """Record ``values`` (tag -> value; None is left out) at ``step``."""
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step, walltime=walltime)
        if self.remote and time.monotonic() - self.rolled_at >= self.roll_seconds:
            self._roll()

    def persist(self) -> None:
        """Make what was logged so far durable (at a checkpoint): flushed, or on its way up."""
        if self.remote:
            if time.monotonic() - self.rolled_at >= PERSIST_SECONDS:
                self._roll()
        else:
            self.writer.flush()

    def _roll(self) -> None:
        self.writer.close()
        closed = sorted(os.listdir(self.staging))  # every file here is closed now
        self.uploads.submit(self._upload, closed)
        self.writer = self._writer_class(self.staging, flush_secs=FLUSH_SECONDS)
        self.rolled_at = time.monotonic()

    def _upload(self, names: list[str]) -> None:
        """Upload each staged file, then delete it; one that fails stays staged for the next try."""
        for name in names:
            local = os.path.join(self.staging, name)
            if not os.path.exists(local):
                continue  # an earlier upload took it
            try:
                self.fs.put_file(local, f"{self.path}/{name}")
            except Exception as exc:  # the store's trouble must not end the run: kept, tried again
                if not self._warned:
                    log.warning("TensorBoard events not uploaded to %s (kept, tried again): %s: %s",
                                self.path, type(exc).__name__, exc)
                    self._warned = True
                continue
            self._warned = False
            os.remove(local)

    def close(self) -> None:
        self.writer.close()
        if self.uploads is not None:
            self.uploads.submit(self._upload, sorted(os.listdir(self.staging)))
            self.uploads.shutdown(wait=True)
            if not os.listdir(self.staging):
                os.rmdir(self.staging)
            else:
                log.warning("TensorBoard events left in %s: the upload to %s failed", self.staging, self.path)
