"""Operator memory and reconcile latency with many concurrent runs.

    python -m bench.operator_scale [--runs 50] [--nodes-per-run 2] [--seconds 30] [--timeout 900]
                                   [--against REV [--rounds 2] [--warmup 15]] [--finished N]

On its own local control plane: --runs TrainingRuns of --nodes-per-run pods each, all running
with progress annotations. Measures the operator process's resident memory and the reconcile
pass duration (its trainium_reconcile_seconds histogram), and compares the memory with a peer:
a bare kopf operator with the same watches (TrainingRuns, pods, nodes, gang orders) and a no-op 1 s timer,
run against the same objects, so the table shows what our logic adds to kopf's own footprint.

With --finished N, after that measurement N more runs are created, run and finish (their pods
Succeeded), and the live runs' passes are measured again beside them: the table gives the live
runs' pass p50/p99 without and with the finished runs (the ratio should be about 1: a finished
run has no tick, reconcile.Result.settled) and the finished runs' own passes per second, from
the operator's per-run trainium_reconcile_passes_total.

With --against REV the peer is the operator of git revision REV instead (its source extracted
with `git archive` into a temporary directory and run from there): REV's operator creates the
pods, then the two operators take turns on the same runs, pods and nodes, one at a time, each
started fresh, given --warmup seconds, then measured for --seconds. --rounds rounds, the order
alternating (REV, working tree, working tree, REV, ...) so a drift of the machine's load over
the run falls on both. The table gives each operator's passes in its measurement windows only
(the difference of two scrapes): mean, p50 and p99 pass duration, CPU per pass, peak RSS, and
the ratio working tree / REV. Both operators run under the same launcher, which gives the pass
histogram fine buckets (10% apart) so the quantiles mean something; the operators are
otherwise unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
# The node controller's grace period on the benchmark's control plane (tools/localcluster reads
# it at import): on two busy cores kwok's heartbeats for 1,024 simulated nodes can lapse past the
# default 20 s, the nodes go Unknown, and an operator without a disruption guard (an earlier
# revision under --against) restarts runs. Node health is not what this benchmark measures.
os.environ.setdefault("TRN_NODE_MONITOR_GRACE", "600s")

from bench.common import stop_cleanly_on_signals, stop_process, table  # noqa: E402
from trainium_api import keys  # noqa: E402
from trainium_api import progress  # noqa: E402

PEER = textwrap.dedent('''
    import asyncio, kopf
    registry = kopf.OperatorRegistry()
    @kopf.on.startup(registry=registry)
    def s(settings, **_): settings.posting.enabled = False
    @kopf.on.login(registry=registry)
    def login(**kw): return kopf.login_via_client(**kw)
    @kopf.index("pods", labels={"trainium.dev/run": kopf.PRESENT}, registry=registry)
    def p(namespace, name, **_): return {namespace: name}
    @kopf.index("nodes", registry=registry)
    def n(name, **_): return {name: name}
    @kopf.index("configmaps", labels={"trainium.dev/gang-order": kopf.PRESENT}, registry=registry)
    def o(namespace, name, **_): return {namespace: name}
    @kopf.timer("trainium.dev", "v1alpha1", "trainingruns", interval=1.0, registry=registry)
    def t(**_): pass
    asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True))
''')


# Runs an operator from the source tree argv[1] (which must be where it imports trainer,
# trainium_api and trainium_operator from) with the arguments after argv[2]; the reconcile pass
# histogram gets the buckets of argv[2]. Both operators of --against run under it.
LAUNCHER = textwrap.dedent('''
    import runpy, sys
    from pathlib import Path
    import prometheus_client
    tree, buckets = Path(sys.argv[1]).resolve(), tuple(float(b) for b in sys.argv[2].split(","))
    init = prometheus_client.Histogram.__init__
    def fine(self, name, *args, **kwargs):
        if name == "trainium_reconcile_seconds":
            kwargs["buckets"] = buckets
        init(self, name, *args, **kwargs)
    prometheus_client.Histogram.__init__ = fine
    import trainer, trainium_api, trainium_operator
    for module in (trainer, trainium_api, trainium_operator):
        if not Path(module.__file__).resolve().is_relative_to(tree):
            sys.exit(f"{module.__name__} comes from {module.__file__}, not from {tree}")
    sys.argv = ["trainium_operator", *sys.argv[3:]]
    runpy.run_module("trainium_operator", run_name="__main__", alter_sys=True)
''')
# 0.2 ms to 10 s, each bucket 10% above the one before: an interpolated quantile is within a
# few percent (the operator's own buckets, 1-5-10-50 ms, cannot tell 12 ms from 40)
FINE_BUCKETS = tuple(round(0.0002 * 1.1 ** i, 7) for i in range(114))


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process (all its threads) so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def histogram(body: str, name: str) -> tuple[float, float, list[tuple[float, float]]]:
    count = total = 0.0
    buckets = []
    for line in body.splitlines():
        if line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
        elif line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
        elif line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    return count, total, buckets


def counter_total(body: str, name: str, runs: set[str] | None = None) -> float:
    """A counter summed over its labels (``runs``: over those runs' series only)."""
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(f"{name}_total")
               and (runs is None or any(f'run="{r}"' in line for r in runs)))


def quantile(buckets, count, q):
    """The upper bound of the bucket holding quantile q."""
    for le, c in buckets:
        if c >= q * count:
            return le
    return float("inf")


def interpolated_quantile(buckets, count, q):
    """Quantile q by linear interpolation in its bucket (Prometheus' histogram_quantile)."""
    rank, lower, below = q * count, 0.0, 0.0
    for le, c in buckets:
        if c >= rank and c > below:
            return lower if le == float("inf") else lower + (le - lower) * (rank - below) / (c - below)
        lower, below = le, c
    return lower


MICRO_BATCH = 4


def run_body(index: int, nodes: int) -> dict:
    """A valid tiny TrainingRun of ``nodes`` pods of one process: data parallel = nodes, so the
    global batch is nodes x the micro batch (a fixed batch would not divide by large DPs)."""
    return {"apiVersion": "trainium.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": f"r{index:03d}"},
            "spec": {"image": "trainer:bench", "nodes": nodes, "instanceType": "cpu", "processesPerNode": 1,
                     "model": {"preset": "tiny"},
                     "training": {"seqLen": 128, "globalBatchSize": nodes * MICRO_BATCH, "microBatchSize": MICRO_BATCH},
                     "data": {"sources": [{"uri": "/d"}], "tokenizer": "/t.json"},
                     "checkpoint": {"uri": f"/tmp/bench-scale-{index}"}}}


def extract(rev: str, into: Path) -> str:
    """REV's tracked files (``git archive``) in ``into``; returns its full commit id."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"bench.operator_scale: --against {rev}: no such commit in {ROOT}")
    sha = found.stdout.strip()
    into.mkdir(parents=True)
    subprocess.run(f"git -C {shlex.quote(str(ROOT))} archive {sha} | tar -x -C {shlex.quote(str(into))}",
                   shell=True, check=True)
    return sha


def working_tree_label() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "api", "operator", "trainer"],
                           capture_output=True, text=True).stdout.strip()
    return f"working tree ({head}{' + uncommitted changes' if dirty else ''})"


def start_operator(tree: Path, env: dict, port: int, log: Path) -> subprocess.Popen:
    """The operator of source tree ``tree``: its api/, operator/ and root alone on the path (and
    as the working directory, which ``python -c`` puts first), metrics on ``port``."""
    env = dict(env, PYTHONPATH=os.pathsep.join(str(tree / part) for part in ("api", "operator", ".")))
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tree), ",".join(map(str, FINE_BUCKETS)),
                                 "--metrics-port", str(port), "--liveness-port", str(port + 1)],
                                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)


def exited(proc: subprocess.Popen, who: str, log: Path) -> SystemExit:
    tail = "".join(open(log, errors="replace").readlines()[-20:])
    return SystemExit(f"bench.operator_scale: {who} exited with {proc.returncode}; the end of its log:\n{tail}")


def report_progress(core, step: int) -> None:
    """Every pod reports ``step`` now (as a trainer would), so no run's hang clock runs out
    however long the benchmark takes."""
    body = progress.ProgressReport(step=step, time=time.time(), tokens_per_second=1000.0, loss=2.0).to_annotation()
    for p in core.list_namespaced_pod("default").items:
        core.patch_namespaced_pod(p.metadata.name, "default", {"metadata": {"annotations": {keys.PROGRESS: body}}})


def running_runs(custom) -> int:
    return sum(1 for r in custom.list_namespaced_custom_object("trainium.dev", "v1alpha1", "default",
                                                               "trainingruns")["items"]
               if (r.get("status") or {}).get("phase") == "Running")


def count_run_writes(custom, seconds: float, out: list) -> None:
    """Appends to ``out`` how many times the TrainingRuns were written in the next ``seconds``
    (status patches and any other write: one MODIFIED event each)."""
    from kubernetes import watch
    since = custom.list_namespaced_custom_object("trainium.dev", "v1alpha1", "default",
                                                 "trainingruns")["metadata"]["resourceVersion"]
    out.append(sum(event["type"] == "MODIFIED" for event in watch.Watch().stream(
        custom.list_namespaced_custom_object, "trainium.dev", "v1alpha1", "default", "trainingruns",
        resource_version=since, timeout_seconds=max(1, round(seconds)))))


def measure_phase(who: str, tree: Path, env: dict, log: Path, custom, args) -> dict:
    """Start ``tree``'s operator, wait for its first passes and --warmup seconds, then take its
    passes, CPU time, RSS and writes of the runs over --seconds; stop it."""
    import threading
    from localcluster.cluster import free_base_port
    port = free_base_port(28000)
    proc = start_operator(tree, env, port, log)
    try:
        deadline = time.monotonic() + args.timeout
        while True:  # leading (the Lease) and passing
            if proc.poll() is not None:
                raise exited(proc, who, log)
            try:
                if histogram(scrape(port), "trainium_reconcile_seconds")[0] > 0:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"bench.operator_scale: {who} made no reconcile pass in {args.timeout:.0f} s")
            time.sleep(0.5)
        time.sleep(args.warmup)
        writes: list[int] = []
        watcher = threading.Thread(target=count_run_writes, args=(custom, args.seconds, writes), daemon=True)
        watcher.start()
        before, cpu0, t0 = scrape(port), cpu_seconds(proc.pid), time.monotonic()
        rss = []
        while time.monotonic() < t0 + args.seconds:
            rss.append(rss_mib(proc.pid))
            time.sleep(1)
        after, cpu1, t1 = scrape(port), cpu_seconds(proc.pid), time.monotonic()
        if proc.poll() is not None:
            raise exited(proc, who, log)
        watcher.join(30)
    finally:
        stop_process(proc)
    c0, s0, b0 = histogram(before, "trainium_reconcile_seconds")
    c1, s1, b1 = histogram(after, "trainium_reconcile_seconds")
    return {"who": who, "passes": c1 - c0, "sum": s1 - s0, "buckets": [(le, c - dict(b0).get(le, 0.0)) for le, c in b1],
            "errors": counter_total(after, "trainium_reconcile_errors") - counter_total(before, "trainium_reconcile_errors"),
            "cpu": cpu1 - cpu0, "seconds": t1 - t0, "rss": max(rss), "writes": writes[0] if writes else float("nan")}


def pooled(phases: list[dict]) -> dict:
    """The phases of one operator taken together (their histogram differences added up)."""
    buckets: dict[float, float] = {}
    for p in phases:
        for le, c in p["buckets"]:
            buckets[le] = buckets.get(le, 0.0) + c
    return {"passes": sum(p["passes"] for p in phases), "sum": sum(p["sum"] for p in phases),
            "buckets": sorted(buckets.items()), "errors": sum(p["errors"] for p in phases),
            "cpu": sum(p["cpu"] for p in phases), "seconds": sum(p["seconds"] for p in phases),
            "rss": max(p["rss"] for p in phases), "writes": sum(p["writes"] for p in phases)}


def figures(p: dict) -> dict:
    n = p["passes"]
    return {"passes": n, "passes/s": n / p["seconds"],
            "mean": 1000 * p["sum"] / n if n else float("nan"),
            "p50": 1000 * interpolated_quantile(p["buckets"], n, 0.50) if n else float("nan"),
            "p99": 1000 * interpolated_quantile(p["buckets"], n, 0.99) if n else float("nan"),
            "cpu/pass": 1000 * p["cpu"] / n if n else float("nan"), "cpu %": 100 * p["cpu"] / p["seconds"],
            "rss": p["rss"], "errors": p["errors"], "writes/s": p["writes"] / p["seconds"]}


def compare(old_tree: Path, old_label: str, env: dict, logs: Path, core, custom, args) -> None:
    """--against: the two operators in turn, ABBA, then the table."""
    new_label = working_tree_label()
    trees = {"old": (old_tree, old_label), "new": (ROOT, new_label)}
    phases, step = [], 10
    for r in range(args.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            step += 10
            report_progress(core, step)
            tree, label = trees[which]
            phase = measure_phase(label, tree, env, logs / f"operator-{len(phases)}-{which}.log", custom, args)
            phases.append({**phase, "which": which, "round": r + 1, "running": running_runs(custom)})
    per_phase = []
    for p in phases:
        f = figures(p)
        per_phase.append([p["round"], p["who"], f"{f['passes']:.0f}", f"{f['passes/s']:.1f}", f"{f['mean']:.2f}",
                          f"{f['p50']:.2f}", f"{f['p99']:.2f}", f"{f['cpu/pass']:.2f}", f"{f['rss']:.0f}",
                          f"{f['writes/s']:.1f}", f"{f['errors']:.0f}", p["running"]])
    print(f"\nEach turn (in the order run), {args.seconds:.0f} s after {args.warmup:.0f} s of warm-up:")
    print(table(["round", "operator", "passes", "passes/s", "mean ms", "p50 ms", "p99 ms", "CPU ms/pass",
                 "RSS MiB", "run writes/s", "errors", "runs Running after"], per_phase))
    old, new = (figures(pooled([p for p in phases if p["which"] == w])) for w in ("old", "new"))
    keys = ("passes/s", "mean", "p50", "p99", "cpu/pass", "cpu %", "rss", "writes/s")
    rows = [[label, f"{f['passes']:.0f}", f"{f['passes/s']:.1f}", f"{f['mean']:.2f}", f"{f['p50']:.2f}",
             f"{f['p99']:.2f}", f"{f['cpu/pass']:.2f}", f"{f['cpu %']:.0f}", f"{f['rss']:.0f}", f"{f['writes/s']:.1f}",
             f"{f['errors']:.0f}"] for label, f in ((old_label, old), (new_label, new))]
    rows.append(["ratio working tree / REV", "", *(f"{new[k] / old[k]:.2f}x" if old[k] else "n/a" for k in keys), ""])
    print(f"\nReconcile pass, {args.against} against the working tree: {args.runs} runs x {args.nodes_per_run} pods, "
          f"{args.rounds} x {args.seconds:.0f} s per operator (passes in the measurement windows only)")
    print(table(["operator", "passes", "passes/s", "mean ms", "p50 ms", "p99 ms", "CPU ms/pass", "CPU %",
                 "peak RSS MiB", "run writes/s", "errors"], rows))


def finished_runs(core, custom, env: dict, work: Path, args) -> None:
    """--finished: one fresh operator measures the live runs' passes (after --warmup), then N
    more runs run and finish beside them, and it measures the live runs' passes again."""
    from localcluster import faults
    from localcluster.nodes import create_nodes
    create_nodes(core, args.finished * args.finished_nodes_per_run, "cpu", "f-")
    port = free_port()
    ours = start_operator(ROOT, env, port, work / "operator-finished.log")
    try:
        report_progress(core, 20)
        time.sleep(args.warmup)
        first = scrape(port)
        time.sleep(args.seconds)
        second = scrape(port)
        done = {f"r{i:03d}" for i in range(args.runs, args.runs + args.finished)}
        for name in sorted(done):
            custom.create_namespaced_custom_object("trainium.dev", "v1alpha1", "default", "trainingruns",
                                                   run_body(int(name[1:]), args.finished_nodes_per_run))
        t0 = time.monotonic()

        def phases() -> dict[str, str]:
            return {r["metadata"]["name"]: (r.get("status") or {}).get("phase", "") for r in
                    custom.list_namespaced_custom_object("trainium.dev", "v1alpha1", "default", "trainingruns")["items"]}
        succeeded: set[str] = set()
        while True:  # each finished run's pods Running, then Succeeded (its trainer exits 0)
            if ours.poll() is not None:
                raise exited(ours, "the operator", work / "operator-finished.log")
            for p in core.list_namespaced_pod("default").items:
                run = (p.metadata.labels or {}).get(keys.RUN)
                if run in done and p.status.phase == "Running" and p.metadata.name not in succeeded:
                    faults.pod_succeed(core, "default", p.metadata.name)
                    succeeded.add(p.metadata.name)
            if all(phases().get(r) == "Succeeded" for r in done):
                break
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"bench.operator_scale: the {args.finished} finished runs were not all Succeeded "
                                 f"after {args.timeout:.0f} s")
            time.sleep(0.5)
        report_progress(core, 30)  # (the finished runs' pods are Succeeded: only the live ones' count)
        time.sleep(args.warmup)
        before = scrape(port)
        time.sleep(args.seconds)
        after = scrape(port)
    finally:
        stop_process(ours)
    live = {f"r{i:03d}" for i in range(args.runs)}
    def window(a: str, b: str) -> tuple[float, list]:
        c0, _, b0 = histogram(a, "trainium_reconcile_seconds")
        c1, _, b1 = histogram(b, "trainium_reconcile_seconds")
        return c1 - c0, [(le, c - dict(b0).get(le, 0.0)) for le, c in b1]
    n0, b_without = window(first, second)
    with_n, with_b = window(before, after)
    finished_passes = (counter_total(after, "trainium_reconcile_passes", done)
                       - counter_total(before, "trainium_reconcile_passes", done)) / args.seconds
    live_passes = (counter_total(after, "trainium_reconcile_passes", live)
                   - counter_total(before, "trainium_reconcile_passes", live)) / args.seconds
    p50 = [1000 * interpolated_quantile(b, n, 0.50) for n, b in ((n0, b_without), (with_n, with_b))]
    p99 = [1000 * interpolated_quantile(b, n, 0.99) for n, b in ((n0, b_without), (with_n, with_b))]
    rows = [["live runs only", args.runs, 0, f"{n0 / args.seconds:.1f}", "", f"{p50[0]:.2f}", f"{p99[0]:.2f}"],
            [f"with {args.finished} finished runs", args.runs, args.finished, f"{live_passes:.1f}",
             f"{finished_passes:.2f}", f"{p50[1]:.2f}", f"{p99[1]:.2f}"],
            ["ratio with / without", "", "", "", "", f"{p50[1] / p50[0]:.2f}x" if p50[0] else "n/a",
             f"{p99[1] / p99[0]:.2f}x" if p99[0] else "n/a"]]
    print(f"\nFinished runs beside {args.runs} live ones (one operator, {args.seconds:.0f} s each after "
          f"{args.warmup:.0f} s of warm-up; pass quantiles over all passes, which are the live runs' once the "
          "finished ones settle):")
    print(table(["measured", "live runs", "finished runs", "live passes/s", "finished passes/s", "pass p50 ms",
                 "pass p99 ms"], rows))


def free_port() -> int:
    from localcluster.cluster import free_base_port
    return free_base_port(28100)


def main() -> None:
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    stop_cleanly_on_signals()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--nodes-per-run", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=900, help="give up (and clean up) if the runs are not all "
                                                                 "Running by then")
    ap.add_argument("--against", metavar="REV", help="compare the reconcile pass with the operator of git revision "
                                                      "REV (e.g. 4b90fe8) instead of a bare kopf")
    ap.add_argument("--rounds", type=int, default=2, help="with --against: measurements per operator, in the "
                                                         "order REV, ours, ours, REV, ... (default 2)")
    ap.add_argument("--warmup", type=float, default=15, help="with --against: seconds each operator runs "
                                                            "before its measurement (default 15)")
    ap.add_argument("--finished", type=int, default=0, metavar="N",
                    help="then N runs that finish, and the live runs measured again beside them")
    ap.add_argument("--finished-nodes-per-run", type=int, default=2, metavar="M",
                    help="pods of each finished run (default 2: what a finished run costs does not depend on it)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.finished and args.against:
        ap.error("--finished measures one operator: leave out --against")
    if args.finished < 0:
        ap.error("--finished must be 0 or more")
    from kubernetes import client
    from localcluster.cluster import Cluster, free_base_port
    from localcluster.nodes import create_nodes

    cluster = Cluster(state_dir=Path(tempfile.mkdtemp(prefix="bench-scale-")), base_port=free_base_port(27000))
    work = Path(tempfile.mkdtemp(prefix="bench-scale-work-"))  # operator logs, REV's source
    procs = []
    try:
        setup_tree = ROOT
        if args.against:
            sha = extract(args.against, work / "rev")
            setup_tree, old_label = work / "rev", f"{args.against} ({sha[:9]})"
        cluster.up()  # in the try: a control plane that fails half-way up is stopped too
        api = cluster.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.wait_established("trainingruns.trainium.dev")
        create_nodes(core, args.runs * args.nodes_per_run, "cpu", "s-")
        env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
        port = free_base_port(28000)
        ours = start_operator(setup_tree, env, port, work / "operator-setup.log")
        procs.append(ours)
        time.sleep(3)
        if ours.poll() is not None:
            raise exited(ours, "the operator", work / "operator-setup.log")
        idle_rss = rss_mib(ours.pid)
        t0 = time.monotonic()
        for i in range(args.runs):
            custom.create_namespaced_custom_object("trainium.dev", "v1alpha1", "default", "trainingruns",
                                                   run_body(i, args.nodes_per_run))
        total_pods = args.runs * args.nodes_per_run
        while (running := sum(p.status.phase == "Running" for p in core.list_namespaced_pod("default").items)) < total_pods:
            invalid = [r for r in custom.list_namespaced_custom_object("trainium.dev", "v1alpha1", "default",
                                                                       "trainingruns")["items"]
                       if (r.get("status") or {}).get("phase") == "Failed"]
            if invalid:
                raise SystemExit(f"bench.operator_scale: {len(invalid)} runs failed, e.g. {invalid[0]['metadata']['name']}: "
                                 f"{invalid[0]['status'].get('message')}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"bench.operator_scale: only {running} of {total_pods} pods Running after "
                                 f"{args.timeout:.0f} s (--timeout)")
            time.sleep(0.5)
        placed = time.monotonic() - t0
        if args.against:
            stop_process(ours)
            print(f"\n{old_label}'s operator placed {total_pods} pods of {args.runs} runs in {placed:.1f} s "
                  f"(idle RSS {idle_rss:.0f} MiB)")
            compare(setup_tree, old_label, env, work, core, custom, args)
            return
        report_progress(core, 10)
        c0, s0, b0 = histogram(scrape(port), "trainium_reconcile_seconds")
        samples = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            samples.append(rss_mib(ours.pid))
            time.sleep(1)
        c1, s1, b1 = histogram(scrape(port), "trainium_reconcile_seconds")
        running = running_runs(custom)
        ours_rss = max(samples)
        stop_process(ours)
        peer = subprocess.Popen([sys.executable, "-c", PEER], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(peer)
        time.sleep(args.seconds / 2)
        peer_rss = max(rss_mib(peer.pid) for _ in range(5) if time.sleep(1) is None)
        stop_process(peer)  # measured: it must not compete with what --finished measures next
        n = c1 - c0
        diff = [(le, c - dict(b0).get(le, 0.0)) for le, c in b1]
        rows = [["trainium-operator", args.runs, running, f"{idle_rss:.0f}", f"{ours_rss:.0f}",
                 f"{1000 * (s1 - s0) / n:.1f}" if n else "n/a",
                 f"{1000 * interpolated_quantile(diff, n, 0.50):.1f}" if n else "n/a",
                 f"{1000 * interpolated_quantile(diff, n, 0.99):.1f}" if n else "n/a",
                 f"{n / args.seconds:.1f}", f"{placed:.1f}"],
                ["bare kopf (no-op timer, same watches)", args.runs, "", "", f"{peer_rss:.0f}", "", "", "", "", ""],
                ["ratio ours / bare kopf (memory)", "", "", "", f"{ours_rss / peer_rss:.2f}x", "", "", "", "", ""]]
        print(f"\nOperator at scale: {args.runs} runs x {args.nodes_per_run} pods ({total_pods} pods, "
              f"{total_pods} nodes), measured over {args.seconds:.0f} s")
        print(table(["operator", "runs", "Running", "idle RSS MiB", "RSS MiB", "pass mean ms",
                     "pass p50 ms", "pass p99 ms", "passes/s", "all pods Running after s"], rows))
        if args.finished:
            finished_runs(core, custom, env, work, args)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p)
        cluster.down()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
