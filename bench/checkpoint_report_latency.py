"""From a save's ``done`` to ``status.lastCheckpoint`` naming it: the pods reporting (now) against
the operator listing the store itself (until commit a3b7afb), measured in the same run.

A tiny TrainingRun (examples/tiny-local-run.yaml through tools/localcluster/drill.manifest: 2
nodes x 2 ranks, a checkpoint every ``--every`` steps, progress every second) trains on the
local control plane with process-backed nodes and the operator of this tree, for
``--checkpoints`` checkpoints. In this process, side by side:

- ours: the run's status is read every 0.1 s; a tag is named when ``status.lastCheckpoint``
  first names it (the pods report each save they complete, the operator's next pass writes it).
  The run's pods are read as often, and the first leg, ``done`` -> a pod's progress annotation
  naming the tag, is printed beside it;
- the peer: the old operator's ``CheckpointLister`` (``operator/trainium_operator/checkpoints.py``
  of commit d00bdff, loaded from git history; its ``.spec`` import is given the two functions it
  took from there), called once a second as the old reconcile pass did, with the run and its
  pods as the API serves them (``observe.pod_view``); a tag is named when ``newest()`` first
  returns it (the value that pass would have written: the status write is not included, which
  favours the peer by a few milliseconds). It lists the store (a local directory here) with
  ``checkpoints.newest_complete`` every 15 s, every second while a gang is about to start, and
  5 s after the last listing when a pod reports a newer checkpoint step.

Ground truth for ``done``: the modification time of the tag's ``done`` file. A tag superseded
before one side named it is counted as never named by that side. Everything started (control
plane, operator, pods) is stopped at the end, on Ctrl-C, SIGTERM and errors.

    python bench/checkpoint_report_latency.py [--checkpoints 10] [--every 5] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench.common import stop_cleanly_on_signals, table  # noqa: E402
from localcluster import drill  # noqa: E402
from localcluster.drill import GROUP, PLURAL, VERSION  # noqa: E402

PEER_REV = "d00bdff"
PEER_PATH = "operator/trainium_operator/checkpoints.py"
PEER_IMPORT = "from .spec import check_checkpoint_uri, checkpoint_layout"
# what the old module took from the old operator/trainium_operator/spec.py: the URI check is
# still the operator's; the layout of a raw spec as d00bdff computed it
PEER_SHIM = '''
from trainium_operator.spec import check_checkpoint_uri
from trainium_api.load import build as _build
from trainium_api.spec import LAYOUTS as _LAYOUTS, TrainerConfig as _TrainerConfig


def checkpoint_layout(raw_spec):
    try:
        trainer = _build(_TrainerConfig, (raw_spec or {}).get("trainer") or {}, "trainer")
    except (ConfigError, TypeError, AttributeError):
        return "trainer"
    return trainer.layout if trainer.is_command and trainer.layout in _LAYOUTS else "trainer"
'''
NODES, NODE_PREFIX = 2, "ckrep-"
STATUS_POLL_SECONDS = 0.1
PEER_PASS_SECONDS = 1.0  # the old reconcile pass: every second per run
AFTER_END_SECONDS = 20.0  # the peer's final listing, once the run ended


def load_peer(workdir: Path):
    """The old CheckpointLister's module, from git history, as ``old_checkpoint_lister``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{PEER_REV}:{PEER_PATH}"], check=True,
                            capture_output=True, text=True).stdout
    if PEER_IMPORT not in source:
        raise SystemExit(f"{PEER_REV}:{PEER_PATH} no longer imports {PEER_IMPORT!r}: update PEER_SHIM")
    path = workdir / "old_checkpoint_lister.py"
    path.write_text(source.replace(PEER_IMPORT, PEER_SHIM))
    spec = importlib.util.spec_from_file_location("old_checkpoint_lister", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def p90(xs: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def latencies(done: dict[str, float], named: dict[str, float]) -> dict[str, float]:
    """Seconds from each tag's ``done`` to its first naming, for the tags that were named."""
    return {tag: named[tag] - t for tag, t in done.items() if tag in named}


def caught_up(done: dict[str, float], named: dict[str, float]) -> dict[str, float]:
    """Seconds from each tag's ``done`` until it or a newer tag (``done`` later) was named: how
    long the status's resume point lagged the store. Every tag that was followed by a naming."""
    out = {}
    for tag, t in done.items():
        later = [named[x] for x, tx in done.items() if tx >= t and x in named]
        if later:
            out[tag] = min(later) - t
    return out


def _stats(xs: list[float]) -> tuple[float | None, float | None, float | None]:
    return (statistics.median(xs), p90(xs), max(xs)) if xs else (None, None, None)


def summary_rows(done: dict[str, float], sides: dict[str, dict[str, float]], peer: str) -> list[list]:
    """One row per side: tags named, never named (superseded first), median and p90 seconds from
    ``done`` to that tag named; median, p90 and max seconds until that tag or a newer one was
    named (every tag counts); and the peer's median and p90 of the latter over this side's."""
    stats = {side: (len(latencies(done, named)), _stats(list(latencies(done, named).values())),
                    _stats(list(caught_up(done, named).values()))) for side, named in sides.items()}
    fmt = (lambda x: "-" if x is None else f"{x:.2f}")
    ratio = (lambda a, b: f"{a / b:.1f}" if a and b else "-")
    base = stats[peer][2]
    return [[side, n, len(done) - n, fmt(exact[0]), fmt(exact[1]), fmt(lag[0]), fmt(lag[1]), fmt(lag[2]),
             ratio(base[0], lag[0]), ratio(base[1], lag[1])] for side, (n, exact, lag) in stats.items()]


SUMMARY_HEADERS = ["method", "named", "never named", "median s (named)", "p90 s (named)",
                   "median s (it or newer)", "p90 s (it or newer)", "max s (it or newer)", "median old/new",
                   "p90 old/new"]


class Watch:
    """Records, per tag, when status.lastCheckpoint (ours), a pod's progress annotation (ours'
    first leg) and the old lister (the peer) first name it. Two threads, each its own API client."""

    def __init__(self, cluster, namespace: str, name: str, lister, pod_view):
        self.cluster, self.ns, self.name = cluster, namespace, name
        self.lister, self.pod_view = lister, pod_view
        self.ours: dict[str, float] = {}
        self.annotated: dict[str, float] = {}  # a pod's progress annotation names it (ours, first leg)
        self.peer: dict[str, float] = {}
        self.phase: str | None = None
        self.ended_at: float | None = None
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._status_loop, name="status", daemon=True),
                         threading.Thread(target=self._peer_loop, name="old-lister", daemon=True)]

    def start(self) -> "Watch":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _status_loop(self) -> None:
        from kubernetes import client
        api_client = self.cluster.api_client()
        core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
        while not self._stop.wait(STATUS_POLL_SECONDS):
            try:
                run = custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)
                pods = core.list_namespaced_pod(self.ns, label_selector=f"trainium.dev/run={self.name}").items
            except Exception as exc:  # noqa: BLE001 - an API hiccup is a missed sample, said at the end
                self.errors.append(f"status: {exc}")
                continue
            now, status = time.time(), run.get("status") or {}
            tag = (status.get("lastCheckpoint") or {}).get("tag")
            if tag and tag not in self.ours:
                self.ours[tag] = now
            for pod in pods:  # the first leg: a pod's progress annotation names the tag
                store = self.pod_view(api_client.sanitize_for_serialization(pod)).store
                if store is not None and store.checkpoint is not None and store.checkpoint.tag not in self.annotated:
                    self.annotated[store.checkpoint.tag] = now
            self.phase = status.get("phase")
            if self.phase in ("Succeeded", "Failed") and self.ended_at is None:
                self.ended_at = now

    def _peer_loop(self) -> None:
        from kubernetes import client
        api_client = self.cluster.api_client()
        core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
        next_pass = time.monotonic()
        while not self._stop.wait(max(0.0, next_pass - time.monotonic())):
            next_pass += PEER_PASS_SECONDS
            try:
                run = custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)
                pods = core.list_namespaced_pod(self.ns, label_selector=f"trainium.dev/run={self.name}").items
                views = [self.pod_view(api_client.sanitize_for_serialization(p)) for p in pods]
                ref = self.lister.newest(run, (run.get("status") or {}).get("phase"), views)
            except Exception as exc:  # noqa: BLE001 - as the old handler: this pass fails, the next one runs
                self.errors.append(f"old lister: {exc}")
                continue
            if ref is not None and ref.tag not in self.peer:
                self.peer[ref.tag] = time.time()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=10, help="checkpoints the run saves (its last step included)")
    ap.add_argument("--every", type=int, default=5, help="steps between checkpoints (checkpoint.intervalSteps)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds the run may take, start-up included")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, store) afterwards")
    ap.add_argument("--quick", action="store_true", help="2 checkpoints, 3 steps apart (the unit test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.checkpoints, args.every = 2, 3
    if args.checkpoints < 1 or args.every < 1:
        ap.error("--checkpoints and --every must be positive")
    stop_cleanly_on_signals()  # a timed-out or cancelled benchmark still stops its control plane
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    from kubernetes import client

    from localcluster.cluster import Cluster, free_base_port
    from trainer.data import tinydata
    from trainium_api import checkpoints
    from trainium_operator.observe import pod_view

    work = Path(tempfile.mkdtemp(prefix="ckpt-report-latency-"))
    peer_module = load_peer(work)
    data = tinydata.ensure(str(work / "data"))
    cluster = Cluster(state_dir=work / "cluster", base_port=free_base_port(start=29000))
    operator = watch = None
    name = "ckpt-latency"
    steps = args.checkpoints * args.every
    ok = False
    try:
        cluster.up()
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.wait_established("trainingruns.trainium.dev")
        drill.process_nodes(cluster, NODES, NODE_PREFIX)
        operator = drill.Operator(cluster, work / "operator.log")
        operator.start()
        drill.new_namespace(client.CoreV1Api(cluster.api_client()), name)
        body = drill.manifest(name, data, work, training={"steps": steps},
                              checkpoint={"intervalSteps": args.every, "keep": steps},
                              logging={"interval": 5, "progressIntervalSeconds": 1})
        d = drill.Drill(cluster, name, body)
        d.create()
        watch = Watch(cluster, name, name, peer_module.CheckpointLister(), pod_view).start()
        print(f"run {name}: {steps} steps, a checkpoint every {args.every}; store {d.ckpt_uri}", flush=True)
        deadline = time.monotonic() + args.timeout
        reported = 0
        while watch.ended_at is None and time.monotonic() < deadline:
            time.sleep(1)
            if len(watch.ours) != reported:
                reported = len(watch.ours)
                print(f"  status names {reported} tag(s), the old lister {len(watch.peer)}; phase {watch.phase}",
                      flush=True)
        if watch.ended_at is None:
            raise SystemExit(f"the run did not end within {args.timeout:.0f}s (phase {watch.phase}); "
                             f"see {work / 'operator.log'}")
        # the peer's final listing (a pod succeeded) may come a pass or two after the end
        last = checkpoints.tag_for_step(steps)
        end = time.monotonic() + AFTER_END_SECONDS
        while time.monotonic() < end and not (last in watch.peer and last in watch.ours):
            time.sleep(0.2)
        watch.stop()
        if watch.phase != "Succeeded":
            raise SystemExit(f"the run ended {watch.phase}: see {work / 'operator.log'}")
        done = {t.tag: t.done_mtime for t in checkpoints.list_tags(d.ckpt_uri, read_meta=False) if t.complete}
        ok = True
    finally:
        if watch:
            watch.stop()
        if operator:
            operator.stop()
        cluster.down(keep_state=True)
        drill.kill_leftovers(cluster.pods_dir)
        if not ok:
            print(f"work directory (logs, store): {work}", flush=True)
    ours_label, peer_label = "pods report (now)", f"old operator listing (CheckpointLister of {PEER_REV})"
    first = min(done.values())
    fmt = (lambda named, tag: f"{named[tag] - done[tag]:.2f}" if tag in named else "never")
    order = sorted(done, key=lambda tag: done[tag])
    print(f"\nper tag: seconds from `done` (its file's mtime) to a pod's progress annotation and to "
          f"status.lastCheckpoint naming it (both polled every {STATUS_POLL_SECONDS} s) / to the old lister's "
          f"newest() naming it (called every {PEER_PASS_SECONDS:.0f} s)\n")
    print(table(["tag", "done (s after the first)", "a pod's annotation", ours_label, peer_label],
                [[tag, f"{done[tag] - first:.1f}", fmt(watch.annotated, tag), fmt(watch.ours, tag),
                  fmt(watch.peer, tag)] for tag in order]))
    print(f"\n{len(done)} checkpoints, {args.every} steps apart; seconds from `done` to status naming the tag "
          f"(named: the tags it named), and to status naming it or a newer one (every tag: how long the resume "
          f"point lagged the store); ratios of the latter, the peer's over ours\n")
    print(table(SUMMARY_HEADERS, summary_rows(done, {ours_label: watch.ours, peer_label: watch.peer}, peer_label)))
    leg = list(latencies(done, watch.annotated).values())
    if leg:
        print(f"\nof which done -> a pod's progress annotation names it (the trainer sees a save finished at its "
              f"next step's end, then reports at once): median {statistics.median(leg):.2f} s, p90 {p90(leg):.2f} s")
    if watch.errors:
        print(f"\n{len(watch.errors)} failed polls (first: {watch.errors[0]})")
    if args.keep:
        print(f"\nwork directory (logs, store): {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
