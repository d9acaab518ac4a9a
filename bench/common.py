"""Helpers shared by the benchmarks: a single-process ParallelState and table printing."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys

from trainer.model import backends
from trainer.config import from_dict


def single_process(cfg, backend: str = "cpu"):
    """The ParallelState of one process on ``backend`` (its Backend object as ``ps.impl``)."""
    from trainer.config import derive_layout
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(var, None)
    impl = backends.pick(backend)
    ps = impl.init_parallel(lambda ws: derive_layout(ws, cfg.model, cfg.parallelism, cfg.training, impl.name),
                            False, "fp32", 1)
    ps.impl = impl
    return ps


def run_config(model: dict, training: dict):
    return from_dict({"model": model, "training": training,
                      "data": {"sources": ["unused"], "tokenizer": "unused"}})


def model_with_adamw(cfg, ps, zero1: bool = False):
    """The benchmark state: a model of ``cfg`` and its AdamW optimizer, moments filled with
    random values (a checkpoint of zeros would compress and hash unlike a real one)."""
    from trainer.model.transformer import Transformer
    from trainer.model.optim import ShardedAdamW
    model = Transformer(cfg.model, seed=0, max_seq_len=cfg.training.seq_len)
    opt = ShardedAdamW(list(model.named_parameters()), cfg.training, ps, zero1=zero1)
    opt.exp_avg.normal_(), opt.exp_avg_sq.uniform_()
    return model, opt


def median(xs):
    return statistics.median(xs)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def stop_cleanly_on_signals() -> None:
    """SIGTERM and SIGHUP (a `timeout`, a closed terminal, a CI job cancelled) raise SystemExit
    like Ctrl-C raises KeyboardInterrupt, so a benchmark's `finally` stops the control plane
    and the processes it started instead of leaving them running."""
    def stop(signum, _frame):
        # once: a second signal (`timeout` forwarding the one `pkill` also sent) must not
        # interrupt the cleanup the first one started
        for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc, timeout: float = 20) -> None:
    """SIGTERM a benchmark's subprocess (an operator, a controller); SIGKILL if it lingers."""
    import subprocess
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def loopback_s3(*buckets: str):
    """moto's S3 server on loopback with ``buckets`` created; yields its endpoint. This process's
    s3fs (and boto3) point at it; pass ``S3_ENV`` plus the endpoint to child processes."""
    import subprocess
    import time

    import boto3
    import fsspec.config
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        deadline = time.monotonic() + 30
        while True:
            try:
                client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("moto's S3 server did not start (pip install 'moto[server]')")
                time.sleep(0.1)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
        yield endpoint
    finally:
        stop_process(server)
