"""Warm workers: the next attempt's launcher and its workers' interpreter, ready before the order.

Most of an in-place restart's seconds went to starting processes: the launcher imports
torchrun, then every worker imports PyTorch and the trainer (bench/e2e_recovery). So the pod's
agent (trainer.pod.agent) keeps one *parked* launcher beside the attempt that runs:
``python -m trainer.pod.launch --warm``, which has imported torchrun, started the watch of the
ranks' output (trainer.pod.outputwatch) and a multiprocessing fork server that has imported
PyTorch and the trainer (``PRELOAD``), and waits on its stdin. The agent's start order hands it
the attempt's command and environment (one JSON line); from there it is the launcher a new
process would have been, except that when the command is ``-m trainer`` torchrun's workers are
forked from the fork server (``start_method="forkserver"``, entrypoint :func:`worker`) instead
of started as new interpreters. Any other command (a user's script, NxD's examples) is started
by torchrun as usual: only the launcher's import is saved.

What differs for a forked worker, and how it is kept the same:
  * its environment: the fork server's (the parked launcher's) plus torchrun's per-worker
    variables. :func:`worker` rebuilds what a started worker would have had: the launcher's
    environment at the order, then torchrun's variables.
  * OpenMP read OMP_NUM_THREADS when the fork server loaded PyTorch: the worker sets its
    thread count from the rebuilt environment.
  * /proc/<pid>/environ still shows the parked environment (ATTEMPT=warm): launcher and workers
    name themselves ``tr-a<attempt>`` / ``tr-a<attempt>-r<rank>`` (trainium_api.agent), which
    ``ps`` shows and the local cluster's process tools read.

The fork server has run no PyTorch operation; the thread pools its libraries size when PyTorch
loads follow OMP_NUM_THREADS, which the parked environment sets as torchrun would (1, unless the
pod sets it). A forked rank asks for SIGTERM when the fork server dies (a stop, with its
stop-save), runs its exit handlers itself (a fork server's child ends with ``os._exit``), and
the launcher ends the fork server before reading the ranks' output to its end.
A parked launcher whose agent goes (its stdin closes) exits. ``TRAINER_WARM_WORKERS=0`` in the
pod's environment turns all of this off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import sys

from trainium_api import podenv as names
from trainium_api.agent import PARKED_ATTEMPT, process_name

from ..contract.podenv import PodEnv, child_environ

PARK_FLAG = "--warm"
PARK_AFTER_SECONDS = 5.0  # after an attempt's start: its own start (imports, rendezvous) first
MAX_PARK_FAILURES = 3  # parked launchers that exit before their order; then restarts start cold
PRELOAD = ["torch", "torch.distributed", "torch.distributed.elastic.multiprocessing", "trainer.loop.train",
           "trainer.pod.warm"]
_FORKSERVER_ENV = child_environ()  # where :func:`worker` runs: the fork server's environment at its start


def _prctl(option: int, arg) -> None:
    """prctl(2) through glibc; where there is none (another libc) the setting is skipped."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)


def set_process_name(name: str) -> None:
    """Linux's name of this process (PR_SET_NAME, what ``ps -o comm`` and /proc/<pid>/comm show)."""
    _prctl(15, name.encode()[:15] + b"\0")


def forks_workers(argv: list[str]) -> bool:
    """Whether the torchrun command ``argv`` runs ``-m trainer`` (its workers can be forked)."""
    for flag in ("-m", "--module"):
        if flag in argv:
            i = argv.index(flag)
            return i + 1 < len(argv) and argv[i + 1] == "trainer"
    return False


def park():
    """In the parked launcher: warm up, then wait for the order. Returns (argv, env, watch) of
    the attempt to run, or None when the agent went without an order."""
    import importlib
    import multiprocessing

    importlib.import_module("torch.distributed.run")  # imported now, not after the order
    from multiprocessing import forkserver, resource_tracker

    from .outputwatch import OutputWatch
    resource_tracker.ensure_running()  # before the watch: it must not hold the watch's pipes
    watch = OutputWatch().start()  # then the fork server, and the ranks it forks, write into it
    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    line = sys.stdin.readline()
    if not line.strip():
        watch.stop()
        return None
    go = json.loads(line)
    os.environ.clear()
    os.environ.update(go["env"])
    set_process_name(process_name(int(go["env"].get("ATTEMPT", "0") or 0)))
    return list(go["argv"]), watch


def stop_fork_server() -> None:
    """End the fork server (the ranks are gone): it holds the output watch's pipes open. It is
    SIGKILLed first: left to end by itself it tears down an interpreter with PyTorch imported
    (0.4 s here), on the path from a failed rank to the agent's report, and has nothing to save."""
    from multiprocessing import forkserver
    server = forkserver._forkserver  # noqa: SLF001
    with contextlib.suppress(AttributeError, OSError, TypeError):
        os.kill(server._forkserver_pid, signal.SIGKILL)  # noqa: SLF001 (None: never started)
    with contextlib.suppress(AttributeError, OSError, ChildProcessError):
        server._stop()  # noqa: SLF001 - the stdlib's own way to end it: closes its pipe, collects it


def run(args) -> None:
    """torch.distributed.run.run(args), with the workers forked from the warm fork server."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args
    if args.standalone:  # as torchrun's own run() does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, cmd_args = config_from_args(args)
    config.start_method = "forkserver"
    trainer_argv = cmd_args[cmd_args.index("trainer") + 1:]
    elastic_launch(config=config, entrypoint=worker)(child_environ(), trainer_argv)


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
"""What torchrun gives each worker (besides TORCHELASTIC_*): taken from the worker's environment
even where the value equals the fork server's."""


def worker(launcher_env: dict, argv: list[str]) -> None:
    """A rank forked from the fork server: the environment a started worker would have, then
    the trainer's main, its exit code the process's."""
    # torch's spawn wrapper asked for SIGINT when the parent (the fork server) dies, which the
    # wrapper swallows: a rank would end mid-step without its stop-save. SIGTERM, as a stop.
    _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    torchrun_vars = {k: v for k, v in child_environ().items()
                     if _FORKSERVER_ENV.get(k) != v or k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(torchrun_vars)
    env = PodEnv.from_environ()  # this rank's entry: its environment is rebuilt
    set_process_name(process_name(int(env.attempt or 0), env.rank))
    import torch
    if (env.omp_num_threads or "").isdigit():
        torch.set_num_threads(int(env.omp_num_threads))
    for stream in (sys.stdout, sys.stderr):  # as a started worker's `python -u`
        stream.reconfigure(line_buffering=True, write_through=True)
    from ..__main__ import main
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # a forked process ends with os._exit: its exit handlers run here
    if code:
        sys.exit(code)


def parked_env() -> dict[str, str]:
    """The environment a parked launcher starts with (the agent's, belonging to no attempt).
    OMP_NUM_THREADS as torchrun gives its workers when unset (1): the fork server's libraries
    (OpenMP, OpenBLAS) size their thread pools from it when PyTorch loads, before any order."""
    omp = PodEnv.from_environ().omp_num_threads
    return child_environ(**{names.ATTEMPT: PARKED_ATTEMPT, "OMP_NUM_THREADS": "1" if omp is None else omp})
