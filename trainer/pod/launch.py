"""python -m trainer.pod.launch [torchrun options] -m trainer --config run.yaml ...

torchrun with the exit-code contract kept: torchrun itself exits 1 whenever a worker fails,
which would hide the difference between "fatal, do not retry" and "retry". This wrapper runs
torchrun in-process and exits with FATAL if any worker exited FATAL, RETRYABLE if any exited
RETRYABLE, TERMINATED on SIGTERM, and 1 for any other failure. The pod contract's command.

When a worker fails, what the Neuron runtime printed about it (a hardware fault, a request for a
new process, a lost peer: trainium_api.runtimefaults) goes into the container's termination
message, at the path the operator names in TERMINATION_LOG_ENV (its pods set it to the
container's terminationMessagePath; unset, nothing is written: we are not in such a pod).

``--agent`` first (in-place restarts): this process becomes the pod's agent (trainer.pod.agent),
which runs the rest of the command as ``python -m trainer.pod.launch`` in a child and starts new
workers on the operator's order instead of ending the pod. ``--warm`` alone: a launcher the
agent parks, warm, for the next attempt (trainer.pod.warm).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
from pathlib import Path
import signal
import subprocess
import sys
import tempfile
import time

from trainium_api import exitcodes, keys, runtimefaults
from trainium_api import preflight as verdicts
from trainium_api.launch import AGENT_FLAG, PRECOMPILE_FLAG, PREFLIGHT_FLAG, PREFLIGHT_SECONDS_ENV

from . import LAUNCHER, liveness, warm
from .outputwatch import OutputWatch
from ..contract import termination
from ..contract.podenv import PRECOMPILE_ENV, PodEnv, child_environ
from ..contract.progress import annotate_own_pod


def _pop_flag(argv: list[str], flag: str) -> str:
    """Remove one of our flags from torchrun's arguments; returns its value ("" when absent)."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
        if arg == "-m" or not arg.startswith("-"):
            break  # the trainer's own arguments begin
    return ""


def _pop_precompile(argv: list[str]) -> int:
    """Remove the pre-compile flag; returns its value (0: off)."""
    return int(_pop_flag(argv, PRECOMPILE_FLAG) or 0)


def preflight(args, value: str, env: PodEnv) -> int:
    """The gang's pre-flight check (trainer.pod.preflight) under torchrun, with the same rendezvous
    (on the next port: a node that finished the check early must not reach the real run's store
    while another still holds the check's). ``value``: FACTOR,TIMEOUT. On success the real run's
    workers learn how long it took (their progress reports carry it: goodput's preflight phase)."""
    import copy

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    check = copy.deepcopy(args)
    check.module, check.no_python = True, False
    check.training_script, check.training_script_args = liveness.CHECK_MODULE, value.split(",")
    check.max_restarts = 0
    if not getattr(check, "standalone", False):
        check.master_port = int(check.master_port) + 1
    print(f"trainer.pod.launch: pre-flight check ({value})", file=sys.stderr, flush=True)
    # the run's Preflight phase comes from this (the operator cannot tell the check from a slow start)
    announced = annotate_own_pod(keys.PREFLIGHT, verdicts.RUNNING, env=env)
    started = time.monotonic()
    beats = tempfile.TemporaryDirectory(prefix="preflight-beats-")
    hung: list[liveness.Hung] = []
    watch = liveness.Watch(Path(beats.name), float(value.split(",")[1]),
                           lambda h: hung.append(h) or _hung_rank(h, env), _hung_rank_lingers)
    # the check is the attempt's first touch of the devices: what the runtime says of a fault
    # there is read as in the real run (a device fault outranks the check's own words)
    output = OutputWatch().start()
    try:
        os.environ[liveness.DIR_ENV] = beats.name  # torchrun passes it to the check's workers
        watch.start()
        run(check)
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        # 76 means "this node failed the check" only here: a training worker's 76 is a crash; a
        # gang-wide verdict (fatal: the image, most nodes) stands over this node's hung rank
        fatal = any(exitcodes.is_fatal(c) for c in codes)
        code = exitcodes.PREFLIGHT if not fatal and (hung or exitcodes.PREFLIGHT in codes) else exit_code_for(codes)
        print(f"trainer.pod.launch: pre-flight check exited {sorted(set(codes))}; pod exit code {code}", file=sys.stderr)
        finding = culprit_view(output.stop(), codes)
        if finding is not None and finding.kind != "peer" and not hung:
            report_fault(finding, env.termination_log)
        return code
    except SignalException:
        return exitcodes.TERMINATED
    finally:
        output.stop()
        watch.stop()
        os.environ.pop(liveness.DIR_ENV, None)
        beats.cleanup()
    if hung:  # named as the workers ended by themselves: the verdict stands
        return exitcodes.PREFLIGHT
    seconds = f"{time.monotonic() - started:.2f}"
    os.environ[PREFLIGHT_SECONDS_ENV] = seconds  # for the real run's workers
    annotate_own_pod(keys.PREFLIGHT, verdicts.DONE, after=announced, env=env)
    if env.preflight_seconds_file:  # a command trainer's watch reports it
        try:
            Path(env.preflight_seconds_file).write_text(seconds)
        except OSError as exc:
            print(f"trainer.pod.launch: could not pass the check's seconds on: {exc}", file=sys.stderr)
    return exitcodes.OK


def _hung_rank(hung: liveness.Hung, env: PodEnv) -> None:
    """One of this pod's ranks hangs in the check (trainer.pod.liveness): the node failed it. Say
    why in the termination message, kill the rank (SIGKILL reaches a stopped process too) so
    torchrun ends the check, and end the pod if torchrun cannot (a process stuck in the kernel)."""
    reason = f"node {liveness.node_name(env)}: {hung.reason}"
    print(f"trainer.pod.launch: this node failed the pre-flight check: {reason}", file=sys.stderr, flush=True)
    termination.write(env.termination_log, verdicts.format_message(reason), _warn)
    with contextlib.suppress(ProcessLookupError):
        os.kill(hung.pid, signal.SIGKILL)


def _hung_rank_lingers() -> None:
    """torchrun did not end the check after the hung rank was killed (a process stuck in the
    kernel does not die): the pod ends without waiting for it."""
    print("trainer.pod.launch: the hung rank did not end; the pod ends without it", file=sys.stderr, flush=True)
    os._exit(exitcodes.PREFLIGHT)


def precompile(argv: list[str], steps: int) -> int:
    """Run ``neuron_parallel_compile python -m trainer.pod.launch ARGV`` for ``steps`` steps."""
    tool = shutil.which("neuron_parallel_compile")
    if tool is None:
        print("trainer.pod.launch: neuron_parallel_compile is not on PATH (it ships with torch-neuronx in the "
              "Neuron training images); turn compileCache.precompileSteps off or use such an image",
              file=sys.stderr)
        return exitcodes.FATAL
    print(f"trainer.pod.launch: pre-compiling the graphs of {steps} steps with neuron_parallel_compile",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    code = subprocess.call([tool, sys.executable, "-m", LAUNCHER, *argv],
                           env=child_environ(**{PRECOMPILE_ENV: str(steps)}))
    print(f"trainer.pod.launch: pre-compilation exited {code} after {time.monotonic() - started:.0f} s",
          file=sys.stderr, flush=True)
    return code


def exit_code_for(worker_codes: list[int]) -> int:
    """One pod exit code from the workers' codes (negative = killed by that signal)."""
    if not worker_codes:
        return exitcodes.OK
    if any(exitcodes.is_fatal(c) for c in worker_codes):
        return exitcodes.FATAL
    if exitcodes.RETRYABLE in worker_codes:
        return exitcodes.RETRYABLE
    terminated = (exitcodes.TERMINATED, -signal.SIGTERM)
    # torchrun SIGTERMs the surviving workers when one fails: a crash among SIGTERMs is a crash
    if any(c not in terminated and c != exitcodes.OK for c in worker_codes):
        return 1
    return exitcodes.TERMINATED


def culprit_view(finding: runtimefaults.Finding | None, worker_codes: list[int]) -> runtimefaults.Finding | None:
    """A "lost a peer" finding is dropped when a worker of this pod was itself killed by a signal
    (other than torchrun's SIGTERM to the survivors): the output is one stream for all local
    ranks, so the peer lines may be its neighbours' words about it, and this pod holds the
    culprit. Device and restart findings always stand."""
    if finding is not None and finding.kind == "peer" and any(
            c < 0 and c != -signal.SIGTERM for c in worker_codes):
        return None
    return finding


def report_fault(finding: runtimefaults.Finding | None, path: str | None) -> None:
    """Say what the runtime said, on stderr and (in a pod) in the termination message."""
    if finding is None:
        return
    print(f"trainer.pod.launch: the Neuron runtime reported {finding.status} ({finding.kind}): {finding.evidence}",
          file=sys.stderr, flush=True)
    termination.write(path, runtimefaults.format_message(finding), _warn)


def _warn(message: str) -> None:
    print(f"trainer.pod.launch: {message}", file=sys.stderr)


def _stop_watch(watch: OutputWatch, forked: bool):
    """The watch's finding, once the ranks' output is read to its end. A warm launcher's fork
    server holds the watch's pipes too: it goes first, or the watch would wait it out."""
    if forked:
        warm.stop_fork_server()
    return watch.stop()


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [AGENT_FLAG]:  # the pod's agent (in-place restarts) runs the rest as its child
        from .agent import serve
        code = serve(argv[1:])
        if code is not None:
            return code
        argv = argv[1:]
    watch = forked = None
    if argv[:1] == [warm.PARK_FLAG]:  # parked by the agent until its start order (trainer.pod.warm)
        parked = warm.park()
        if parked is None:
            return exitcodes.OK
        argv, watch = parked
        forked = warm.forks_workers(argv)
    env = PodEnv.from_environ()  # after a parked launcher's start order: its environment
    steps = _pop_precompile(argv)
    check = _pop_flag(argv, PREFLIGHT_FLAG)
    args = parse_args(argv)
    if check and env.precompile_steps is None:  # before pre-compiling: it costs seconds, that minutes
        code = preflight(args, check, env)
        if code != exitcodes.OK:
            return code
    if steps > 0:
        code = precompile(argv, steps)
        if code != exitcodes.OK:
            return code
    watch = watch or OutputWatch().start()
    try:
        if forked:
            warm.run(args)
        else:
            run(args)
    except ChildFailedError as exc:
        # the pod is ending: a SIGTERM now (a teardown) must not cut the report short (torch's
        # handler is still installed and would raise out of this block)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        finding = _stop_watch(watch, forked)
        codes = [f.exitcode for f in exc.failures.values()]
        code = exit_code_for(codes)
        print(f"trainer.pod.launch: workers exited {sorted(set(codes))}; pod exit code {code}", file=sys.stderr)
        report_fault(culprit_view(finding, codes), env.termination_log)
        return code
    except SignalException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # stopped (a teardown): a rank whose runtime reported a hardware fault before it was
        # told to stop is still this node's fault (the operator reads it in teardown); a lost
        # peer is not worth saying here, everyone lost one
        finding = _stop_watch(watch, forked)
        if finding is not None and finding.kind != "peer":
            report_fault(finding, env.termination_log)
        return exitcodes.TERMINATED
    finally:
        _stop_watch(watch, forked)
    return exitcodes.OK


def _exit(code: int | None) -> None:
    """End the process without the interpreter's teardown of its modules (PyTorch imported: about
    0.4 s here, on the path from a failed rank to the agent's report and the restart): the exit
    handlers run, non-daemon threads are joined and the streams are flushed (C's too) as on a
    normal exit."""
    import ctypes
    import threading
    threading._shutdown()  # noqa: SLF001 - what a normal exit does first: joins non-daemon threads
    atexit._run_exitfuncs()  # (logging's shutdown among them)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # what C code printed without a newline to a pipe
    os._exit(int(code or 0))


if __name__ == "__main__":
    _exit(main())
