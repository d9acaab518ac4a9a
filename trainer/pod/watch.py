"""python -m trainer.pod.watch --format nxd|nxdt|regex [options] -- COMMAND ...

Runs COMMAND (an unmodified training script under torchrun), passes its stdout and stderr
through byte for byte, reads its progress lines and writes the same progress annotation our
trainer writes (trainer.contract.progress), at the same bounded rate. COMMAND's exit code is this
process's exit code (a command killed by signal N exits 128 + N, as a shell reports it).
SIGTERM and SIGINT are forwarded to COMMAND, which decides how to stop.

Built-in formats (the upstream code that prints them is named in tests/fixtures/upstream_logs.yaml):

  nxd   NeuronX Distributed examples, rank 0 every --logging_interval steps:
        ``LOG <asctime> - (<epoch>, <step>) step_loss : <loss> learning_rate : <lr> throughput : <x> seq/s``
  nxdt  NxD Training: the Lightning progress bar's postfix (``reduced_train_loss=``, ``global_step=``,
        ``throughput=``), its updates separated by carriage returns
  regex a user's regular expression with the named group ``step`` and optionally ``loss`` and
        ``throughput`` (samples per second), searched in every line

No torch here. The formats and the regex rules are the API's (trainium_api.spec: PROGRESS_FORMATS,
check_regex); this module has a parser for each.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import re
import signal
import subprocess
import sys
import threading
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainium_api.exitcodes import FATAL, RETRYABLE
from trainium_api.launch import PREFLIGHT_SECONDS_FILE_ENV
from trainium_api.progress import CheckpointSeen, ProgressReport, StoreReport
from trainium_api.spec import LAYOUTS, PROGRESS_FORMATS, check_regex

from ..contract import progress
from ..contract.podenv import PodEnv
from ..store import errors as store_errors
from .store_watch import (LEADER_WAIT_SECONDS, MIN_REFRESH_SECONDS, StoreWatch, await_leader, leader_pod,
                          resume_arguments, seen)

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# logger.py of NxD's tp_zero1_llama_hf_pretrain (and its siblings): the "seq/s" suffix, the
# param_norm / grad-norm tails and a torchrun "[0]:" prefix vary between releases and launchers.
NXD_LINE = re.compile(rf"LOG .+? - \((?P<epoch>\d+), (?P<step>\d+)\) step_loss : (?P<loss>{_NUM})\s+"
                      rf"learning_rate : (?P<lr>{_NUM})\s+throughput : (?P<throughput>{_NUM})")
# Lightning's progress bar postfix (NxDT's log_metrics, prog_bar=True): key=value pairs in any order.
_NXDT_FIELD = {"step": re.compile(rf"[\s,]global_step=(?P<v>{_NUM})"),
               "loss": re.compile(rf"[\s,]reduced_train_loss=(?P<v>{_NUM})"),
               "throughput": re.compile(rf"[\s,]throughput=(?P<v>{_NUM})")}


@dataclass
class Sample:
    step: int
    loss: float | None = None
    throughput: float | None = None  # samples (sequences) per second


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _step(text: str) -> int | None:
    # NxDT's bar shows floats padded to 4 digits ("12.00") and tqdm's 3 significant digits
    # once shorter ("1e+4"): exact below 100,000 steps, rounded beyond.
    value = _number(text)
    return None if value is None or not math.isfinite(value) else int(round(value))


def _from_match(m: re.Match) -> Sample | None:
    groups = m.groupdict()
    step = _step(groups["step"]) if groups.get("step") is not None else None
    if step is None:
        return None
    return Sample(step, _number(groups.get("loss")), _number(groups.get("throughput")))


def parse_nxd(segment: str) -> Sample | None:
    m = NXD_LINE.search(segment)
    return _from_match(m) if m else None


def parse_nxdt(segment: str) -> Sample | None:
    found = {k: rx.search(" " + segment) for k, rx in _NXDT_FIELD.items()}
    if not found["step"]:
        return None
    step = _step(found["step"].group("v"))
    if step is None:
        return None
    return Sample(step, *(_number(found[k].group("v")) if found[k] else None for k in ("loss", "throughput")))


FORMATS: dict[str, Callable[[str], Sample | None]] = {"nxd": parse_nxd, "nxdt": parse_nxdt}
assert set(PROGRESS_FORMATS) == {*FORMATS, "regex"}, "a progress format of the API without a parser"


def parser_for(fmt: str, regex: str = "") -> Callable[[str], Sample | None]:
    if fmt == "regex":
        why = check_regex(regex)
        if why:
            raise ValueError(f"--regex: {why}")
        rx = re.compile(regex)
        return lambda segment: (m := rx.search(segment)) and _from_match(m) or None
    return FORMATS[fmt]


class Segments:
    """Text from a byte stream, cut at newlines and carriage returns (a progress bar redraws its
    line with a carriage return); a partial segment waits for the rest of it."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[str]:
        text = self._pending + self._decoder.decode(data)
        parts = re.split(r"[\r\n]", text)
        self._pending = parts.pop()
        if len(self._pending) > 1 << 16:  # a runaway line is not progress; do not hold it forever
            self._pending = ""
        return [p for p in parts if p]

    def close(self) -> list[str]:
        rest, self._pending = self._pending + self._decoder.decode(b"", final=True), ""
        return [rest] if rest else []


class Tracker:
    """Newest step seen, reported through the progress annotation when the step advances, with
    what the pod sees of its checkpoint store (trainer.pod.store_watch) when that changes."""

    def __init__(self, parse: Callable[[str], Sample | None], reporter, tokens_per_sample: int = 0,
                 start_step: int = 0, clock: Callable[[], float] = time.time):
        self.parse, self.reporter, self.tokens_per_sample = parse, reporter, tokens_per_sample
        self.start_step, self.clock = start_step, clock
        self.step: int | None = None
        self.samples = 0
        self.store = StoreReport()
        self._last: tuple = (None, None, None, None)  # (step, tokens/s, loss, step time) last reported
        self._lock = threading.Lock()

    def segment(self, text: str) -> None:
        sample = self.parse(text)
        if sample is None:
            return
        with self._lock:
            if self.step is not None and sample.step <= self.step:
                return  # a redraw of the same step, or an older line
            self.step = sample.step
            self.samples += 1
            tps = (sample.throughput * self.tokens_per_sample
                   if sample.throughput is not None and self.tokens_per_sample else None)
            self._last = (sample.step, tps, sample.loss, self.clock())
            self._send(force=False)

    def decided(self, chosen: CheckpointSeen | None) -> None:
        """Where COMMAND resumes: reported at once, step or not (node rank 0's word is what the
        other pods of the gang wait for)."""
        with self._lock:
            self.start_step = (chosen.step or 0) if chosen is not None else 0
            self.store = StoreReport(chosen, self.store.error if chosen is None else None)
            self._send(force=True)

    def store_changed(self, store: StoreReport) -> None:
        """A new view of the store: reported at once (a new checkpoint, or the store failing)."""
        with self._lock:
            self.store = store
            self._send(force=True)

    def _send(self, force: bool) -> None:
        step, tps, loss, at = self._last
        last_step = self.store.checkpoint.step if self.store.checkpoint else None
        self.reporter.report(ProgressReport(step=step, time=at, tokens_per_second=tps, loss=loss,
                                            last_checkpoint_step=last_step, start_step=self.start_step,
                                            preflight_seconds=self.preflight_seconds(), store=self.store), force=force)

    def preflight_seconds(self) -> float | None:
        """What the launcher's pre-flight check took (it writes the file once the check passed)."""
        path = PodEnv.from_environ().preflight_seconds_file  # written by the launcher while this runs
        try:
            return float(Path(path).read_text()) if path else None
        except (OSError, ValueError):
            return None


def _pump(src, dst, segments: Segments, tracker: Tracker) -> None:
    fd = src.fileno()
    while True:
        data = _read(fd)
        if not data:
            break
        dst.write(data)
        dst.flush()
        for seg in segments.feed(data):
            tracker.segment(seg)
    for seg in segments.close():
        tracker.segment(seg)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def run(command: list[str], tracker: Tracker) -> int:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout.buffer, Segments(), tracker), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr.buffer, Segments(), tracker), daemon=True)]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join(10)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("trainer.pod.watch: usage: python -m trainer.pod.watch --format FORMAT [options] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ours, command = argv[:split], argv[split + 1:]
    ap = argparse.ArgumentParser(prog="python -m trainer.pod.watch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=PROGRESS_FORMATS, required=True)
    ap.add_argument("--regex", default="", help="with --format regex: named groups step, loss, throughput")
    ap.add_argument("--tokens-per-sample", type=int, default=0,
                    help="sequence length: tokens per second = throughput (samples/s) x this (0: not reported)")
    env = PodEnv.from_environ()
    ap.add_argument("--checkpoint-uri", default=env.checkpoint_uri,
                    help="the checkpoint store this pod lists (default $CHECKPOINT_URI; empty: not listed)")
    ap.add_argument("--checkpoint-layout", choices=LAYOUTS, default="nxd",
                    help="its layout; nxdt: COMMAND gets the newest complete checkpoint to resume from")
    ap.add_argument("--interval", type=float, default=5.0, help="minimum seconds between progress annotations")
    args = ap.parse_args(ours)
    if not command:
        ap.error("no COMMAND after --")
    try:
        parse = parser_for(args.format, args.regex)
    except ValueError as exc:
        ap.error(str(exc))
    reporter = progress.ProgressReporter(args.interval, env=env)
    # the launcher (our child) writes the pre-flight check's seconds here; we report them
    os.environ.setdefault(PREFLIGHT_SECONDS_FILE_ENV, os.path.join(tempfile.mkdtemp(prefix="trainer-watch-"),
                                                                   "preflight-seconds"))
    tracker = Tracker(parse, reporter, args.tokens_per_sample)
    # listed once per progress interval (node rank 0): a save is reported about as soon as a step
    store = StoreWatch(args.checkpoint_uri, args.checkpoint_layout, tracker.store_changed,
                       refresh_seconds=max(args.interval, MIN_REFRESH_SECONDS)) if args.checkpoint_uri else None
    try:
        code = _run_with_store(command, tracker, store, args.checkpoint_layout, env)
    finally:
        reporter.close()
    return code


def _run_with_store(command: list[str], tracker: Tracker, store: StoreWatch | None, layout: str, env: PodEnv) -> int:
    """COMMAND, told where to resume (the newest complete checkpoint, as node rank 0 lists it
    from its pod: trainer.pod.store_watch), with the store listed while it runs and once more at its
    exit (node rank 0)."""
    leader = env.node_rank == "0"
    if store is not None:
        try:
            chosen = _resume_point(store, leader, env)
        except store_errors.StoreUnavailable as exc:  # another attempt may read it
            print(f"trainer.pod.watch: {exc}", file=sys.stderr)
            return RETRYABLE
        except store_errors.StoreConfigError as exc:  # refused for minutes, or never answerable
            print(f"trainer.pod.watch: invalid configuration: spec.checkpoint.uri: {exc}", file=sys.stderr)
            return FATAL
        tracker.decided(chosen)  # said at once: the other pods of the gang wait for node rank 0's word
        command = [*command, *resume_arguments(layout, store.view.root, chosen)]
        if leader:
            store.start()
    try:
        return run(command, tracker)
    except FileNotFoundError as exc:
        print(f"trainer.pod.watch: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    finally:
        if store is not None and leader:
            store.stop(final=True)


def _resume_point(store: StoreWatch, leader: bool, env: PodEnv) -> CheckpointSeen | None:
    """Node rank 0 lists the store (each failure said in its report: storeError, the run's
    CheckpointStoreReadable); another pod takes node rank 0's choice for this attempt from its
    pod, and lists the store itself only where it cannot read it."""
    pod0 = None if leader else leader_pod(env.pod_name)
    attempt = env.attempt_number
    api = progress.connect_api(env) if pod0 and attempt is not None else None
    if api is not None:
        answered, chosen = await_leader(api, env.pod_namespace, pod0, attempt)
        if answered:
            return chosen
        print(f"trainer.pod.watch: no checkpoint choice from {pod0} within {LEADER_WAIT_SECONDS:.0f}s; "
              f"listing the store from this pod", file=sys.stderr)
    return seen(store.at_start())


if __name__ == "__main__":
    sys.exit(main())
