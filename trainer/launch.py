"""python -m trainer.launch [torchrun options] -m trainer --config run.yaml ...

torchrun with the exit-code contract kept: torchrun itself exits 1 whenever a worker fails,
which would hide the difference between "fatal, do not retry" and "retry". This wrapper runs
torchrun in-process and exits with FATAL if any worker exited FATAL, RETRYABLE if any exited
RETRYABLE, TERMINATED on SIGTERM, and 1 for any other failure. The pod contract's command.
"""

from __future__ import annotations

import signal
import sys

from . import exitcodes


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


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        code = exit_code_for(codes)
        print(f"trainer.launch: workers exited {sorted(set(codes))}; pod exit code {code}", file=sys.stderr)
        return code
    except SignalException:
        return exitcodes.TERMINATED
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
