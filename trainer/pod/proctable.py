"""This machine's processes as a pod sees them in /proc, for code that must find its own
descendants (the in-place agent, the pre-flight launcher's hang watch).

A pod's /proc may number its host's processes (a container runtime that mounts no /proc of its
own, the local cluster's pods) rather than the pod's PID namespace: a process is known by its
number in /proc, and signalled by its pid in its own innermost namespace (the NSpid line).
"""

from __future__ import annotations

import os
from pathlib import Path


def status_fields(number: int | str) -> dict[str, str] | None:
    """/proc/<number>/status as its fields (PPid, NSpid, State, SigIgn, ...), None when gone."""
    try:
        text = Path(f"/proc/{number}/status").read_text()
    except OSError:
        return None
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def status(number: int | str) -> tuple[int, int, str] | None:
    """/proc/<number>: (its parent's number in /proc, its pid in its own innermost namespace,
    its state), None when gone."""
    fields = status_fields(number)
    try:
        return (int(fields["PPid"]), int(fields.get("NSpid", str(number)).split()[-1]),
                fields.get("State", "?").split()[0])
    except (TypeError, KeyError, ValueError, IndexError):  # (TypeError: gone)
        return None


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every process in /proc: its number there -> status."""
    table = {int(e): status(e) for e in os.listdir("/proc") if e.isdigit()}
    return {n: st for n, st in table.items() if st is not None}


def proc_self() -> int:
    """This process's number in /proc's numbering (which may be the host's)."""
    return int(os.readlink("/proc/self"))


PF_EXITING = 0x4  # include/linux/sched.h: the process is tearing itself down
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(number: int | str) -> list[str]:
    """/proc/<number>/stat's fields after the process's name (its 3rd on: state, ppid, ...)."""
    return Path(f"/proc/{number}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(number: int | str) -> float | None:
    """The CPU time (user + system) the process /proc/<number> has used, None when gone."""
    try:
        fields = _stat(number)
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # stat's 14th and 15th fields
    except (OSError, ValueError, IndexError):
        return None


def demand(number: int | str) -> tuple[float, dict[str, float], bool] | None:
    """What the process /proc/<number> has asked of the CPUs: (the CPU time it used, the time
    each of its threads waited runnable for a CPU (schedstat's run_delay, by thread id), whether
    one of its threads is runnable now); None when gone. CPU time alone reads a busy process
    starved by its neighbours (a node's other pods, a contended host) as idle: it uses almost
    nothing while it waits its turn, and the wait shows only in the run queue. (Threads are
    given apart: the process's CPU time keeps its ended threads', the waits do not.)"""
    used = cpu_seconds(number)
    try:
        threads = os.listdir(f"/proc/{number}/task")
    except OSError:
        return None
    if used is None:
        return None
    where = [f"{number}/task/{t}" for t in threads]
    waited = {t: w for t, at in zip(threads, where) if (w := _run_delay(at)) is not None}
    return used, waited, any(_state(at) == "R" for at in where)


def _run_delay(where: str) -> float | None:
    """/proc/<where>/schedstat's time waited runnable, in seconds; None when the thread ended
    or the kernel keeps no schedstat (CONFIG_SCHED_INFO)."""
    try:
        return int(Path(f"/proc/{where}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _state(where: str) -> str | None:
    """/proc/<where>'s state (R, S, D, T, Z, ...), None when gone."""
    try:
        return _stat(where)[0]
    except (OSError, IndexError):
        return None


def live_children(running: str) -> dict[int, str]:
    """This process's children whose command line holds ``running`` and that are neither
    ended nor exiting: their pid (this process's own numbering) -> state (R, S, D, T, ...)."""
    me = proc_self()
    out = {}
    for number, (ppid, pid, state) in process_table().items():
        if ppid != me or state in ("Z", "X"):
            continue
        try:
            flags = int(_stat(number)[6])
            argv = Path(f"/proc/{number}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if not flags & PF_EXITING and running in argv:
            out[pid] = state
    return out
