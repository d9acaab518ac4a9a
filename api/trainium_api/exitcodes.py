"""Exit codes of the trainer: the pod contract (docs/architecture.md 3.2). The trainer exits with
them, the operator classifies a pod's exit code with :func:`is_fatal`.

    0    OK          training finished (or nothing left to do)
    78   FATAL       do not retry: invalid config, missing data or tokenizer, NaN with nanPolicy=stop
    75   RETRYABLE   try again: a checkpoint could not be written, a transient store failure
    76   PREFLIGHT   this node failed the pre-flight check (trainer.pod.preflight): the gang restarts without it
    143  TERMINATED  SIGTERM: the in-flight checkpoint was finalized, then we exited
    any other        retryable (a crash, a killed rank, a lost peer)
"""

OK = 0
RETRYABLE = 75  # EX_TEMPFAIL
PREFLIGHT = 76
FATAL = 78  # EX_CONFIG
TERMINATED = 143  # 128 + SIGTERM

FATAL_CODES = frozenset({FATAL})


def is_fatal(code: int | None) -> bool:
    return code in FATAL_CODES


class FatalError(RuntimeError):
    """Raised for conditions where a retry cannot help; the trainer exits with FATAL."""
