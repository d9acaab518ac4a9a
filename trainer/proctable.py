"""This machine's processes as a pod sees them in /proc, for code that must find its own
descendants (the in-place agent, the pre-flight launcher's hang watch).

A pod's /proc may number its host's processes (a container runtime that mounts no /proc of its
own, the local cluster's pods) rather than the pod's PID namespace: a process is known by its
number in /proc, and signalled by its pid in its own innermost namespace (the NSpid line).
"""

from __future__ import annotations

import os
from pathlib import Path


def status(number: int | str) -> tuple[int, int, str] | None:
    """/proc/<number>: (its parent's number in /proc, its pid in its own innermost namespace,
    its state), None when gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{number}/status").read_text().splitlines()
                      if ":" in line)
        return (int(fields["PPid"]), int(fields.get("NSpid", str(number)).split()[-1]),
                fields.get("State", "?").split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every process in /proc: its number there -> status."""
    table = {int(e): status(e) for e in os.listdir("/proc") if e.isdigit()}
    return {n: st for n, st in table.items() if st is not None}


def proc_self() -> int:
    """This process's number in /proc's numbering (which may be the host's)."""
    return int(os.readlink("/proc/self"))


def live_children() -> list[int]:
    """The pids (this process's own numbering) of its children that have not ended."""
    me = proc_self()
    return [pid for ppid, pid, state in process_table().values() if ppid == me and state not in ("Z", "X")]
