"""tools/cluster COMMAND: build, start, stop and break a local Kubernetes control plane.

  build                        build/reuse etcd, kube-*, kwok, kwokctl, helm (Go modules, cached)
  up [--nodes N --type T] [--processes | --containers]
                               start on loopback, write a kubeconfig, wait for /readyz
  down                         stop exactly what `up` started and delete the state dir
  status                       which components run; the kubeconfig path
  env                          print `export KUBECONFIG=...` (eval "$(tools/cluster env)")
  nodes --count N --type T [--processes | --containers]
                               create simulated nodes (trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge, trn2u.48xlarge, cpu);
                               --processes: process-backed (proc-...), their pods run for real;
                               --containers: their pods run for real from their images (proc-ctr-...,
                               podman; tools/images builds ours)
  logs POD [-n NS] [-f]        a process-backed pod's stdout and stderr
  fault KIND TARGET [...]      inject a fault; `recover KIND TARGET` undoes it
      node-not-ready NODE   node-unreachable NODE   node-partition NODE (looks lost, keeps running)
      neuron-error NODE [--reason R]        the Neuron node problem detector's NeuronHealth
      accelerated-hardware NODE [--reason R]
                                            the EKS node monitoring agent's AcceleratedHardwareReady=False
                                            (default NeuronHBMUncorrectableError)
      karpenter-disrupt NODE                Karpenter's taint and drain, the node deleted once empty
      spot-interruption NODE [--notice-seconds S]
                                            a Spot interruption as Karpenter handles it: event, taint,
                                            drain, the node deleted after the notice (default 120 s)
      device-plugin-restart SECONDS         every Neuron node's devices unregistered that long
      device-loss NODE [--remaining K]   delete-node NODE
      pod-fail POD [--namespace NS --exit-code C --reason R]   evict POD [--namespace NS]
      hang POD [--namespace NS]             SIGSTOP every process of a process-backed pod
      kill-rank POD [RANK] [--namespace NS] SIGKILL one rank (default the pod's lowest)
      apiserver-down SECONDS                stop kube-apiserver that long, then start it again
      etcd-restart SECONDS                  stop etcd that long (0: a restart), then start it again

Options before the command: --state-dir DIR and --base-port P (default ~/.cache/trainium-
operator/cluster-state and 23790; TRN_CLUSTER_STATE / TRN_CLUSTER_PORT set them too), so two
clusters can run at once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings

from . import faults
from .cluster import DEFAULT_BASE_PORT, DEFAULT_STATE, HERE, Cluster, ClusterError
from .nodes import INSTANCE_TYPES, create_nodes

NODE_FAULTS = {"node-not-ready": (faults.node_not_ready, faults.node_recover),
               "node-unreachable": (faults.node_unreachable, faults.node_recover),
               "node-partition": (faults.node_partition, faults.node_recover),
               "neuron-error": (faults.neuron_error, faults.neuron_healthy),
               "accelerated-hardware": (faults.accelerated_hardware, faults.accelerated_hardware_ready),
               "karpenter-disrupt": (faults.karpenter_disrupt, faults.return_node),
               "spot-interruption": (faults.spot_interruption, faults.return_node),
               "device-loss": (faults.device_loss, faults.device_restore),
               "delete-node": (faults.delete_node, None)}
POD_FAULTS = {"pod-fail": faults.pod_fail, "evict": faults.evict_pod}
PROCESS_FAULTS = ("hang", "kill-rank", "runtime-fault", "runtime-restart")  # on the processes of process-backed pods
CONTROL_PLANE_FAULTS = {"apiserver-down": faults.apiserver_down, "etcd-restart": faults.etcd_restart}  # TARGET: seconds
FLEET_FAULTS = ("device-plugin-restart",)  # TARGET: seconds, every Neuron node


def _core(cluster: Cluster):
    from kubernetes import client
    return client.CoreV1Api(cluster.api_client())


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    ap = argparse.ArgumentParser(prog="tools/cluster", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE))
    ap.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    up = sub.add_parser("up")
    up.add_argument("--nodes", type=int, default=0)
    up.add_argument("--type", default="trn1.32xlarge", choices=list(INSTANCE_TYPES))
    up.add_argument("--processes", action="store_true", help="process-backed nodes: their pods run for real")
    up.add_argument("--containers", action="store_true",
                    help="container-backed nodes: their pods run for real, from their images (podman)")
    sub.add_parser("down")
    logs = sub.add_parser("logs")
    logs.add_argument("pod")
    logs.add_argument("-n", "--namespace", default="default")
    logs.add_argument("-f", "--follow", action="store_true")
    sub.add_parser("status")
    sub.add_parser("env")
    nodes = sub.add_parser("nodes")
    nodes.add_argument("--count", type=int, required=True)
    nodes.add_argument("--type", default="trn1.32xlarge", choices=list(INSTANCE_TYPES))
    nodes.add_argument("--prefix")
    nodes.add_argument("--processes", action="store_true", help="process-backed nodes: their pods run for real")
    nodes.add_argument("--containers", action="store_true",
                       help="container-backed nodes: their pods run for real, from their images (podman)")
    for verb in ("fault", "recover"):
        f = sub.add_parser(verb)
        f.add_argument("kind", choices=[*NODE_FAULTS, *POD_FAULTS, *PROCESS_FAULTS, *CONTROL_PLANE_FAULTS, *FLEET_FAULTS]
                       if verb == "fault" else
                       [*(k for k, v in NODE_FAULTS.items() if v[1]), "hang"])
        f.add_argument("target")
        f.add_argument("rank", nargs="?", type=int, help="kill-rank: the global rank to kill")
        f.add_argument("--namespace", default="default")
        f.add_argument("--exit-code", type=int, default=1)
        f.add_argument("--reason")
        f.add_argument("--remaining", type=int, default=12)
        f.add_argument("--notice-seconds", type=float, default=faults.SPOT_NOTICE_SECONDS)
    args = ap.parse_args(argv)
    cluster = Cluster(state_dir=args.state_dir, base_port=args.base_port)
    try:
        if args.cmd == "build":
            return subprocess.call(["bash", str(HERE / "build.sh")])
        if args.cmd == "up":
            cluster.up()
            if args.nodes:
                names = create_nodes(_core(cluster), args.nodes, args.type, processes=args.processes,
                                     containers=args.containers)
                print(f"created {len(names)} {args.type} nodes: {names[0]} .. {names[-1]}")
        elif args.cmd == "down":
            cluster.down()
        elif args.cmd == "status":
            st = cluster.status()
            for name, state in st.items():
                print(f"{name:26s} {state}")
            print(f"kubeconfig: {cluster.kubeconfig}" if st else "not running")
            return 0 if cluster.running() else 1
        elif args.cmd == "env":
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.cmd == "nodes":
            names = create_nodes(_core(cluster), args.count, args.type, args.prefix, processes=args.processes,
                                 containers=args.containers)
            print(f"{len(names)} {args.type} nodes: {', '.join(names)}")
        elif args.cmd == "logs":
            return _logs(cluster, args.namespace, args.pod, args.follow)
        elif args.cmd == "fault" and args.kind in CONTROL_PLANE_FAULTS:
            took = CONTROL_PLANE_FAULTS[args.kind](cluster, float(args.target))
            print(f"fault {args.kind}: {args.kind.split('-')[0]} back after {took:.1f}s")
        elif args.cmd == "fault" and args.kind in FLEET_FAULTS:
            core = _core(cluster)
            nodes = [n.metadata.name for n in core.list_node().items
                     if faults.NEURON in (n.status.capacity or {})]
            print(f"fault {args.kind}: Neuron devices of {len(nodes)} nodes unregistered for {args.target}s", flush=True)
            faults.device_plugin_restart(core, nodes, float(args.target))
            print(f"fault {args.kind}: registered again")
        elif args.cmd == "fault" and args.kind in ("karpenter-disrupt", "spot-interruption"):
            core = _core(cluster)
            end = faults.spot_interruption(core, args.target, args.notice_seconds) \
                if args.kind == "spot-interruption" else faults.karpenter_disrupt(core, args.target)
            print(f"fault {args.kind} {args.target}: tainted {faults.keys.KARPENTER_DISRUPTED}, draining"
                  + (f"; deleted in {args.notice_seconds:.0f}s at the latest" if end.deadline else
                     "; deleted once drained") + " (Ctrl-C stops the drain, the node stays)", flush=True)
            try:
                end.wait()
            except KeyboardInterrupt:
                end.cancel()
                print(f"fault {args.kind} {args.target}: drain stopped; `recover {args.kind} {args.target}` returns it")
                return 130
            print(f"fault {args.kind} {args.target}: node deleted")
        elif args.cmd in ("fault", "recover") and args.kind in PROCESS_FAULTS:
            if args.kind == "kill-rank":
                rank, pid = faults.kill_rank(cluster.pods_dir, args.namespace, args.target, args.rank)
                print(f"fault kill-rank {args.target}: SIGKILL rank {rank} (pid {pid})")
            elif args.kind == "runtime-fault":
                rank, pid = faults.runtime_fault(cluster.pods_dir, args.namespace, args.target)
                print(f"fault runtime-fault {args.target}: rank {rank} (pid {pid}) printed an HBM error and was SIGKILLed")
            elif args.kind == "runtime-restart":
                rank, pid = faults.runtime_fault(cluster.pods_dir, args.namespace, args.target,
                                                 faults.NUMERICAL_ERROR_LINE)
                print(f"fault runtime-restart {args.target}: rank {rank} (pid {pid}) printed a numerical error "
                      "(the runtime asks for a new process) and was SIGKILLed")
            else:
                fn = faults.hang_pod if args.cmd == "fault" else faults.unhang_pod
                pids = fn(cluster.pods_dir, args.namespace, args.target)
                print(f"{args.cmd} hang {args.target}: {'SIGSTOP' if args.cmd == 'fault' else 'SIGCONT'} "
                      f"{len(pids)} processes")
        elif args.cmd in ("fault", "recover"):
            core = _core(cluster)
            if args.kind in POD_FAULTS:
                if args.kind == "pod-fail":
                    faults.pod_fail(core, args.namespace, args.target, args.exit_code, args.reason or "Error")
                else:
                    faults.evict_pod(core, args.namespace, args.target)
            else:
                inject, undo = NODE_FAULTS[args.kind]
                fn = inject if args.cmd == "fault" else undo
                if args.cmd == "fault" and args.kind in ("neuron-error", "accelerated-hardware") and args.reason:
                    fn(core, args.target, args.reason)
                elif args.cmd == "fault" and args.kind == "device-loss":
                    fn(core, args.target, args.remaining)
                else:
                    fn(core, args.target)
            print(f"{args.cmd} {args.kind} {args.target}: done")
    except (ClusterError, LookupError) as exc:
        print(f"tools/cluster: {exc}", file=sys.stderr)
        return 2
    return 0


def _logs(cluster: Cluster, namespace: str, pod: str, follow: bool) -> int:
    """Print a process-backed pod's log; with --follow keep printing until the pod finished."""
    import time

    from . import podprocs
    pod_dir = podprocs.latest_pod_dir(cluster.pods_dir, namespace, pod)
    with open(pod_dir / podprocs.LOG, "rb") as fh:
        while True:
            chunk = fh.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            elif not follow or podprocs.read_record(pod_dir).get("finished"):
                return 0
            else:
                time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
