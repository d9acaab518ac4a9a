"""Telling the pod's agent that a checkpoint is being written (trainium_api.agent.BUSY_DIR_ENV).

After a hang the agent ends the stop's grace early once the workers use no CPU (stuck, they
would save nothing). A save is the exception: ranks waiting in its barrier while another pod
uploads, or in an fsync or an S3 request, are idle by the CPU and still saving. While a save
runs, its process keeps a file in the agent's directory, and the agent waits the whole grace.
A rank that runs its SIGTERM handler leaves one too (:func:`mark`): it is alive, and saves at
its next step boundary, however long it waits on a peer or its device meanwhile; a rank stuck in
a collective or a frozen device never gets to its handler. A file left by a killed process only
costs the next stop its early end: the agent empties the directory before it starts new workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from .podenv import PodEnv


def _path(what: str) -> Path | None:
    directory = PodEnv.from_environ().busy_dir  # per save: a worker's marks, far from its entry
    return Path(directory) / f"{what}-{os.getpid()}-{threading.get_ident()}" if directory else None


def _touch(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.touch()


def mark(what: str) -> None:
    """Leave this process's ``what`` file for the rest of the attempt (no agent: nothing)."""
    _touch(_path(what))


@contextlib.contextmanager
def busy(what: str):
    """While the body runs, the agent (if any) sees this thread ``what``-ing."""
    path = _path(what)
    _touch(path)
    try:
        yield
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()
