"""Watch the ranks' output for what the Neuron runtime says when it fails (trainer.pod.launch).

torchrun's workers inherit the launcher's stdout and stderr. :class:`OutputWatch` puts a pipe
under each (fd 1 and 2), copies every byte on to where the stream went before, unchanged and at
once (the container log looks as it did), and scans each line for the runtime's fault
signatures (trainium_api.runtimefaults). When a worker fails, the launcher writes the most
serious recent finding into the container's termination message, where the operator reads it.

Why pipes under the launcher rather than torchrun's ``--tee``: tee rewrites every console
line with a rank prefix and polls files, and a user's own ``--redirects`` would turn it off.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from trainium_api import runtimefaults

LINE_LIMIT = 64 * 1024
"""A line longer than this is scanned in pieces (a runaway print must not grow memory)."""
RECENT_SECONDS = 300.0
"""Only what was printed this long before the failure counts: a peer's connection reset during
an S3 retry hours earlier, or an early NaN warning, says nothing about a later crash."""


class OutputWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[runtimefaults.Finding, float]] = {}  # kind -> newest finding, when
        self._streams: list[tuple[int, int]] = []  # (fd, its original destination, dup'ed)
        self._threads: list[threading.Thread] = []
        self._stopped = False

    def start(self) -> "OutputWatch":
        for fd in (1, 2):
            try:
                original = os.dup(fd)
            except OSError:
                continue  # no such stream: nothing to watch
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._streams.append((fd, original))
            t = threading.Thread(target=self._pump, args=(read_end, original), daemon=True,
                                 name=f"output-watch-{fd}")
            t.start()
            self._threads.append(t)
        return self

    def finding(self, within: float = RECENT_SECONDS) -> runtimefaults.Finding | None:
        """The most serious finding printed in the last ``within`` seconds."""
        now = time.monotonic()
        with self._lock:
            return runtimefaults.worst(f for f, t in self._seen.values() if now - t <= within)

    def stop(self, timeout: float = 2.0) -> runtimefaults.Finding | None:
        """Put the streams back and read what is left (safe to call twice); the finding. A
        process that outlived its worker and still holds a pipe (a compiler or data-loader
        child) is not waited for beyond ``timeout``: its copier keeps the original stream,
        and keeps copying, until that process lets go."""
        if not self._stopped:
            self._stopped = True
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            for fd, original in self._streams:
                os.dup2(original, fd)
            deadline = time.monotonic() + timeout
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
        return self.finding()

    def _pump(self, read_end: int, out: int) -> None:
        """Copy until every writer has let go, then close both ends: the copier owns ``out``
        (closing it elsewhere while this thread may still write would send bytes to whatever
        file reuses the number)."""
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(read_end, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                _write_all(out, chunk)
                try:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > LINE_LIMIT:
                        lines.append(pending)
                        pending = b""
                    for line in lines:
                        self.see(line.decode(errors="replace"))
                except Exception:  # never stop draining: the workers would block on a full pipe
                    pending = b""
            if pending:
                self.see(pending.decode(errors="replace"))
        finally:
            os.close(read_end)
            os.close(out)

    def see(self, line: str) -> None:
        found = runtimefaults.scan([line])
        if found is not None:
            with self._lock:
                self._seen[found.kind] = (found, time.monotonic())


def _write_all(fd: int, data: bytes) -> None:
    """Copy on; a destination that went away (the log reader closed it) does not stop the
    copying: the workers must never block on a full pipe."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return
