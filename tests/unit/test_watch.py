"""trainer.pod.watch: upstream progress formats (tests/fixtures/upstream_logs.yaml, verbatim), the
byte stream cut at newlines and carriage returns, the user's regex checked, and the wrapper run
as a real process: output passed through unchanged, the exit code passed through, SIGTERM
forwarded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer.pod import watch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = yaml.safe_load((ROOT / "tests" / "fixtures" / "upstream_logs.yaml").read_text(encoding="utf-8"))


class Recorder:
    """Collects what the tracker would write on the pod (the reporter's interface)."""

    def __init__(self):
        self.reports = []

    def report(self, report, force=False):
        self.reports.append({"step": report.step, "tps": report.tokens_per_second, "loss": report.loss,
                             "time": report.time, "start": report.start_step, "preflight": report.preflight_seconds,
                             "store": report.store, "checkpointStep": report.last_checkpoint_step})


def stream_of(sample: dict) -> bytes:
    text = sample.get("text") or "\r".join(sample["redraws"]) + "\n"
    return text.encode("utf-8")


def run_tracker(fmt: str, data: bytes, chunk: int, **kw) -> Recorder:
    rec = Recorder()
    tracker = watch.Tracker(watch.parser_for(fmt, kw.pop("regex", "")), rec, **kw)
    segments = watch.Segments()
    for i in range(0, len(data), chunk):
        for seg in segments.feed(data[i:i + chunk]):
            tracker.segment(seg)
    for seg in segments.close():
        tracker.segment(seg)
    return rec


@pytest.mark.parametrize("fmt,index", [(f, i) for f in ("nxd", "nxdt") for i in range(len(FIXTURES[f]))])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_upstream_lines_give_step_loss_and_throughput(fmt, index, chunk):
    sample = FIXTURES[fmt][index]
    rec = run_tracker(fmt, stream_of(sample), chunk, tokens_per_sample=4096)
    # a redraw of the same step is not progress: only advancing steps are reported
    want = []
    for step, loss, tput in sample["expect"]:
        if not want or step > want[-1][0]:
            want.append((step, loss, tput))
    assert [(r["step"], r["loss"], None if r["tps"] is None else round(r["tps"] / 4096, 6)) for r in rec.reports] \
        == [(s, l, t) for s, l, t in want], sample["source"]


def test_nxdt_redraws_are_cut_at_carriage_returns_and_partial_redraws_wait():
    sample = FIXTURES["nxdt"][1]
    first, second = (r.encode() for r in sample["redraws"])
    rec = Recorder()
    tracker = watch.Tracker(watch.parse_nxdt, rec)
    seg = watch.Segments()
    for s in seg.feed(b"\r" + first + b"\r" + second[:40]):  # the second redraw is still being written
        tracker.segment(s)
    assert [r["step"] for r in rec.reports] == [1]
    for s in seg.feed(second[40:] + b"\r"):
        tracker.segment(s)
    assert [r["step"] for r in rec.reports] == [1, 3]


def test_tqdm_rounding_of_large_steps_is_read_as_a_number():
    # Lightning pads to 5 characters and tqdm switches to 3 significant digits when shorter
    assert watch.parse_nxdt("..., global_step=1e+4, consumed_samples=1.02e+7]").step == 10000
    assert watch.parse_nxdt("..., global_step=12.00, consumed_samples=12288.0]").step == 12
    assert watch.parse_nxdt("throughput_peak=3.0, no step here") is None
    # throughput_peak is not throughput
    s = watch.parse_nxdt("x, throughput_peak=9.0, global_step=5.000, throughput=2.5]")
    assert (s.step, s.throughput) == (5, 2.5)


def test_start_step_and_step_time_are_reported():
    rec = run_tracker("nxd", stream_of(FIXTURES["nxd"][1]), 1 << 16, start_step=100)
    assert {r["start"] for r in rec.reports} == {100}
    assert all(r["time"] and abs(r["time"] - time.time()) < 60 for r in rec.reports)
    assert all(r["tps"] is None for r in rec.reports)  # without --tokens-per-sample: not known


def test_user_regex_is_checked_and_used():
    assert watch.check_regex(r"it (?P<step>\d+) loss (?P<loss>[\d.]+)") is None
    assert "invalid regular expression" in watch.check_regex(r"(?P<step>\d+")
    assert "named group 'step'" in watch.check_regex(r"iteration (\d+)")
    assert "unknown named group 'lr'" in watch.check_regex(r"(?P<step>\d+) (?P<lr>\S+)")
    rec = run_tracker("regex", b"iteration 7 loss 2.5 | 10.0 samples/s\niteration 8 loss 2.25 | 12 samples/s\n", 5,
                      regex=r"iteration (?P<step>\d+) loss (?P<loss>[\d.]+) \| (?P<throughput>[\d.]+)",
                      tokens_per_sample=10)
    assert [(r["step"], r["loss"], r["tps"]) for r in rec.reports] == [(7, 2.5, 100.0), (8, 2.25, 120.0)]


def _watch(args: list[str], **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("POD_NAME", "KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "api")])  # this tree's trainer and trainium_api
    return subprocess.Popen([sys.executable, "-m", "trainer.pod.watch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT, **kw)


def test_output_and_exit_code_pass_through_unchanged():
    bar = "\r".join(FIXTURES["nxdt"][1]["redraws"])
    script = ("import sys; sys.stdout.buffer.write(b'line one\\nno newline at the end'); sys.stdout.flush(); "
              f"sys.stderr.write({bar!r}); sys.exit(3)")
    proc = _watch(["--format", "nxdt", "--", sys.executable, "-c", script])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out == b"line one\nno newline at the end"
    assert err.decode("utf-8") == bar


def test_sigterm_is_forwarded_and_a_signalled_command_exits_128_plus_n():
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('child got SIGTERM', flush=True), sys.exit(143)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    proc = _watch(["--format", "nxd", "--", sys.executable, "-c", script])
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and b"child got SIGTERM" in out
    killed = _watch(["--format", "nxd", "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
    killed.communicate(timeout=30)
    assert killed.returncode == 128 + 9


def test_bad_invocations_are_refused():
    proc = _watch(["--format", "regex", "--regex", "(?P<x>1)", "--", "true"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and b"named group 'step'" in err
    proc = _watch(["--format", "nxd"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and b"usage" in err
    proc = _watch(["--format", "nxd", "--", "/nonexistent/script"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127 and b"cannot run" in err


def test_the_launchers_preflight_seconds_reach_the_report(tmp_path, monkeypatch):
    """The launcher (the watch's child) writes what its pre-flight check took into the file the
    watch names; the watch's reports carry it (goodput's preflight phase, the skip's record)."""
    from trainium_api.launch import PREFLIGHT_SECONDS_FILE_ENV
    seconds = tmp_path / "preflight-seconds"
    monkeypatch.setenv(PREFLIGHT_SECONDS_FILE_ENV, str(seconds))
    rec = Recorder()
    tracker = watch.Tracker(watch.parse_nxdt, rec)
    tracker.segment("Epoch 0:   1%|          | 1/100 [00:01<02:00, global_step=1.000, reduced_train_loss=9.0]")
    seconds.write_text("4.25")
    tracker.segment("Epoch 0:   2%|          | 2/100 [00:02<02:00, global_step=2.000, reduced_train_loss=8.0]")
    assert [r["preflight"] for r in rec.reports] == [None, 4.25]
