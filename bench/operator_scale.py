"""Operator memory and reconcile latency with many concurrent runs.

    python -m bench.operator_scale [--runs 50] [--nodes-per-run 2] [--seconds 30] [--timeout 900]

On its own local control plane: --runs TrainingRuns of --nodes-per-run pods each, all running
with progress annotations. Measures the operator process's resident memory and the reconcile
pass duration (its trainium_reconcile_seconds histogram), and compares the memory with a peer:
a bare kopf operator with the same watches (TrainingRuns, pods, nodes) and a no-op 1 s timer,
run against the same objects, so the table shows what our logic adds to kopf's own footprint.
"""

from __future__ import annotations

import argparse
import os
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

from bench.common import stop_cleanly_on_signals, table  # noqa: E402
from trainer import progress  # noqa: E402

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
    @kopf.timer("trainium.dev", "v1alpha1", "trainingruns", interval=1.0, registry=registry)
    def t(**_): pass
    asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True))
''')


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def histogram(port: int, name: str) -> tuple[float, float, list[tuple[float, float]]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
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


def quantile(buckets, count, q):
    for le, c in buckets:
        if c >= q * count:
            return le
    return float("inf")


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


def main() -> None:
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    stop_cleanly_on_signals()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--nodes-per-run", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=900, help="give up (and clean up) if the runs are not all "
                                                                 "Running by then")
    args = ap.parse_args()
    from kubernetes import client
    from localcluster.cluster import Cluster, free_base_port
    from localcluster.nodes import create_nodes

    cluster = Cluster(state_dir=Path(tempfile.mkdtemp(prefix="bench-scale-")), base_port=free_base_port(27000))
    cluster.up()
    procs = []
    try:
        api = cluster.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/trainingruns.trainium.dev", "--timeout=60s")
        create_nodes(core, args.runs * args.nodes_per_run, "cpu", "s-")
        env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
        port = free_base_port(28000)
        ours = subprocess.Popen([sys.executable, "-m", "trainium_operator", "--metrics-port", str(port),
                                 "--liveness-port", str(port + 1)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(ours)
        time.sleep(3)
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
        body = progress.payload(10, 1000.0, 2.0, None)
        for p in core.list_namespaced_pod("default").items:
            core.patch_namespaced_pod(p.metadata.name, "default", {"metadata": {"annotations": {progress.ANNOTATION: body}}})
        c0, s0, b0 = histogram(port, "trainium_reconcile_seconds")
        samples = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            samples.append(rss_mib(ours.pid))
            time.sleep(1)
        c1, s1, b1 = histogram(port, "trainium_reconcile_seconds")
        running = sum(1 for r in custom.list_namespaced_custom_object("trainium.dev", "v1alpha1", "default",
                                                                      "trainingruns")["items"]
                      if (r.get("status") or {}).get("phase") == "Running")
        ours_rss = max(samples)
        ours.terminate()
        ours.wait(20)
        peer = subprocess.Popen([sys.executable, "-c", PEER], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(peer)
        time.sleep(args.seconds / 2)
        peer_rss = max(rss_mib(peer.pid) for _ in range(5) if time.sleep(1) is None)
        n = c1 - c0
        diff = [(le, c - dict(b0).get(le, 0.0)) for le, c in b1]
        rows = [["trainium-operator", args.runs, running, f"{idle_rss:.0f}", f"{ours_rss:.0f}",
                 f"{1000 * (s1 - s0) / n:.1f}" if n else "n/a", f"<= {1000 * quantile(diff, n, 0.95):.0f}" if n else "n/a",
                 f"{n / args.seconds:.1f}", f"{placed:.1f}"],
                ["bare kopf (no-op timer, same watches)", args.runs, "", "", f"{peer_rss:.0f}", "", "", "", ""],
                ["ratio ours / bare kopf (memory)", "", "", "", f"{ours_rss / peer_rss:.2f}x", "", "", "", ""]]
        print(f"\nOperator at scale: {args.runs} runs x {args.nodes_per_run} pods ({total_pods} pods, "
              f"{total_pods} nodes), measured over {args.seconds:.0f} s")
        print(table(["operator", "runs", "Running", "idle RSS MiB", "RSS MiB", "reconcile mean ms",
                     "reconcile p95 ms", "passes/s", "all pods Running after s"], rows))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)
        cluster.down()


if __name__ == "__main__":
    main()
