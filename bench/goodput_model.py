"""A goodput model for the 128-node Llama 2 7B run (examples/llama2-7b.yaml) at one fault every
3 hours: the effective training ratio with the gang recreated, restarted in place, and in place
with warm spares, from the operator's measured latencies and Trainium's documented costs.

    python -m bench.goodput_model [--mtbf-hours 3] [--interval-steps 200] [--graph-load 10,60]

Nothing here runs: it is arithmetic over the figures in ``COSTS``, each with where it comes from
(a measurement of ours in bench/README.md, or a cited source; docs/neuron.md lists them). What
nobody has published (loading the compiled graphs from the cache) is a parameter, shown at two
values. The peer is the recreate path, computed from the same figures.

Per fault, the seconds lost are: detection; the operator's restart (the new attempt's pods
running); for pods new to a node, the container start, and the image pull on a node that never
ran the image; the workers' start (imports), the Neuron runtime's start and the graph load; the
checkpoint restore (the store, or the memory tier: this node's copy, a peer's for a new node);
and the recomputation of the steps since the newest complete checkpoint (on average half an
interval plus the time a save takes to become complete). Faults are of two kinds: a process
fault (the nodes stay trusted: in place) and a node fault (a node is left: its pod replaced, by
a spare when there is one), in the share the Llama 3 paper reports for hardware. The checkpoint
stalls come on top: one per interval.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.common import table


@dataclass(frozen=True)
class Cost:
    seconds: float
    source: str


COSTS = {
    # measured here (bench/README.md, 128 simulated trn1.32xlarge nodes, 2026-11-26)
    "detect_process": Cost(0.05, "ours, bench/recovery_latency 128 nodes: a crash reported by the pod's agent, p50"),
    "detect_node": Cost(0.25, "ours, bench/recovery_latency 128 nodes: NotReady seen, p50 (after the node controller "
                              "marks it; Kubernetes' node-monitor-grace-period comes first for a silent node)"),
    "restart_recreate": Cost(5.60, "ours, bench/recovery_latency 128 nodes: recreate, detection -> 128 new pods Running"),
    "restart_in_place": Cost(6.23, "ours, bench/recovery_latency 128 nodes: in-place barrier, detection -> started"),
    "restart_replace": Cost(6.48, "ours, bench/recovery_latency 128 nodes: one pod replaced, the rest in place"),
    "imports_cold": Cost(4.84, "ours, bench/e2e_recovery kill-rank, in place with cold workers: detection -> first "
                               "new step (launcher and ranks started, imports, rendezvous, restore, one step)"),
    "imports_warm": Cost(1.43, "ours, bench/e2e_recovery kill-rank, in place with warm workers (trainer.pod.warm): the same"),
    "restore_memory": Cost(0.27, "ours, bench/checkpoint_restore: 1.07 GB from this node's memory in 0.325 s, "
                                 "scaled to 0.875 GB (a node's 1/128 of 112 GB)"),
    "restore_peer": Cost(1.45, "ours, bench/checkpoint_restore: 1.07 GB from the next node over gloo (loopback TCP) "
                               "in 1.771 s, scaled to 0.875 GB"),
    # documented elsewhere
    "nrt_start": Cost(6.7, "aws-neuron-sdk issue 1361: nrt_init about 6.7 s per process (a user's report, trn2/trn3)"),
    "container_start": Cost(2.0, "assumed: a container whose image the node holds (no published EKS figure found)"),
    "image_pull": Cost(300.0, "AWS ML blog, SOCI index on DLAMI and DLC: 15-20 GB images take 4-6 min per instance "
                              "(0 when every node pre-pulls the image)"),
    "store_read_gbps": Cost(3.0, "FSx for Lustre PERSISTENT_2 at 250 MB/s per TiB (AWS FSx Lustre guide), 12 TiB: "
                                 "3 GB/s for the whole gang"),
    "state_gb": Cost(112.0, "Llama 2 7B with fp32 master weights and AdamW moments: 7e9 x 16 bytes"),
    "step": Cost(1.37, "docs/neuron.md: 1,024 x 4,096-token sequences per step at about 750 sequences/s on 128 "
                       "nodes (8 x the published 93.3 on 16, aws-neuron-sdk training_data_decoder.csv)"),
    "save_stall": Cost(0.5, "ours, bench/checkpoint_stall: an asynchronous save's stall (1.61 GB state, host copy)"),
    "node_fault_share": Cost(0.78, "Llama 3 paper (arXiv 2407.21783): about 78% of unexpected interruptions were "
                                   "confirmed or suspected hardware issues"),
}


def lost_per_fault(mode: str, node_fault: bool, graph_load: float, interval_steps: int,
                   what_if: dict | None = None) -> dict[str, float]:
    """Seconds lost by one fault, by phase (``what_if``: figures replaced)."""
    c = {k: v.seconds for k, v in COSTS.items()}
    store_restore = c["state_gb"] / c["store_read_gbps"]
    # a save is restorable once complete: its writes go the same way, the whole state at the
    # store's throughput (the memory copy is kept only once the store's is complete)
    c["durable_lag"] = store_restore
    c.update(what_if or {})
    durable_lag = c["durable_lag"]
    out = {"detect": c["detect_node"] if node_fault else c["detect_process"]}
    if mode == "recreate":
        out["restart"] = c["restart_recreate"] + c["container_start"]
        out["image"] = c["image_pull"] if node_fault else 0.0  # the replacement node never ran the image
        out["start"] = c["imports_cold"] + c["nrt_start"] + graph_load
        out["restore"] = store_restore
    elif not node_fault:  # in place, either way
        out["restart"] = c["restart_in_place"]
        out["image"] = 0.0
        out["start"] = c["imports_warm"] + c["nrt_start"] + graph_load
        out["restore"] = c["restore_memory"]
    elif mode == "in-place":  # one new pod on a new node
        out["restart"] = c["restart_replace"] + c["container_start"]
        out["image"] = c["image_pull"]
        out["start"] = c["imports_cold"] + c["nrt_start"] + graph_load
        out["restore"] = c["restore_peer"]
    else:  # a warm spare takes the index: pod, image and imports already paid
        out["restart"] = c["restart_replace"]
        out["image"] = 0.0
        out["start"] = c["imports_warm"] + c["nrt_start"] + graph_load
        out["restore"] = c["restore_peer"]
    out["recompute"] = (interval_steps * c["step"] / 2 + durable_lag if c.get("rollback", 1)
                        else c["step"] / 2)  # no rollback: only the step the fault cut short
    return out


def goodput(mode: str, mtbf: float, graph_load: float, interval_steps: int,
            what_if: dict | None = None) -> tuple[float, float]:
    """(effective training ratio, mean seconds lost per fault)."""
    share = COSTS["node_fault_share"].seconds
    lost = (share * sum(lost_per_fault(mode, True, graph_load, interval_steps, what_if).values())
            + (1 - share) * sum(lost_per_fault(mode, False, graph_load, interval_steps, what_if).values()))
    stall = (what_if or {}).get("save_stall", COSTS["save_stall"].seconds)
    return 1 - lost / mtbf - stall / (interval_steps * COSTS["step"].seconds), lost


def interval_for(target: float, mode: str, mtbf: float, graph_load: float, what_if: dict | None = None) -> int | None:
    """The checkpoint interval (steps) with the best goodput, if that reaches ``target``; else None."""
    best = max(range(1, 2001), key=lambda steps: goodput(mode, mtbf, graph_load, steps, what_if)[0])
    return best if goodput(mode, mtbf, graph_load, best, what_if)[0] >= target else None


# What would have to be true for 99.5%, one change after another, on the spares path.
WHAT_IF = [
    ("a save restorable from memory as soon as its host copy exists (the store's write goes on behind)",
     {"durable_lag": 1.0}),
    ("the Neuron runtime kept across an in-place restart (no nrt_init)", {"nrt_start": 0.0}),
    ("the compiled graphs kept loaded (no graph load)", {"graph": 0.0}),
    ("a save's stall of 0.1 s (a node's 0.875 GB host copy; ours measured 0.5 s for 1.61 GB)", {"save_stall": 0.1}),
    ("no rollback: a lost rank's state rebuilt from its data-parallel replicas (HyperPod's checkpointless "
     "recovery), so a fault loses only the step it cut short", {"rollback": 0}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtbf-hours", type=float, default=3.0, help="mean time between faults of the whole run")
    ap.add_argument("--interval-steps", type=int, default=200, help="checkpoint interval (the example's: 200)")
    ap.add_argument("--graph-load", default="10,60", help="seconds to load the compiled graphs (not published)")
    ap.add_argument("--target", type=float, default=0.995)
    args = ap.parse_args()
    mtbf = args.mtbf_hours * 3600
    modes = {"recreate": "gang recreated", "in-place": "in place (node fault: one new pod)",
             "spares": "in place + warm spares"}
    graph_loads = [float(g) for g in args.graph_load.split(",")]
    print("Figures (seconds unless named):")
    print(table(["figure", "value", "source"], [[k, f"{v.seconds:g}", v.source] for k, v in COSTS.items()]))
    for graph in graph_loads:
        print(f"\nGraph load {graph:g} s, checkpoint every {args.interval_steps} steps, one fault every "
              f"{args.mtbf_hours:g} h ({COSTS['node_fault_share'].seconds:.0%} node faults)\n")
        rows, base = [], None
        for mode, label in modes.items():
            ratio, lost = goodput(mode, mtbf, graph, args.interval_steps)
            base = base or lost
            by_phase = {k: 0.0 for k in lost_per_fault(mode, True, graph, args.interval_steps)}
            share = COSTS["node_fault_share"].seconds
            for node_fault, weight in ((True, share), (False, 1 - share)):
                for k, v in lost_per_fault(mode, node_fault, graph, args.interval_steps).items():
                    by_phase[k] += weight * v
            need = interval_for(args.target, mode, mtbf, graph)
            rows.append([label, f"{ratio:.4f}", f"{lost:.1f}", f"{lost / base:.2f}x",
                         " / ".join(f"{by_phase[k]:.1f}" for k in by_phase),
                         f"<= {need} steps ({need * COSTS['step'].seconds:.0f} s)" if need else "none"])
        print(table(["mode", "goodput", "lost s / fault", "vs recreate",
                     "detect / restart / image / start / restore / recompute", f"interval for {args.target:.1%}"],
                     rows))
    budget = (1 - args.target) * mtbf
    print(f"\n{args.target:.1%} at one fault every {args.mtbf_hours:g} h leaves {budget:.0f} s per fault for "
          "everything, recomputation and the stalls of the saves included.")
    graph = max(graph_loads)
    print(f"\nWhat would have to be true for {args.target:.1%} (in place + warm spares, graph load {graph:g} s; "
          "each line adds its change to those above; the interval is the best one for the line)\n")
    rows, what_if = [], {}
    for label, change in [("as measured and documented", {}), *WHAT_IF]:
        what_if = {**what_if, **change}
        g = what_if.get("graph", graph)
        steps = max(range(1, 2001), key=lambda n: goodput("spares", mtbf, g, n, what_if)[0])
        ratio, lost = goodput("spares", mtbf, g, steps, what_if)
        rows.append([label, f"{steps} ({steps * COSTS['step'].seconds:.0f} s)", f"{lost:.1f}", f"{ratio:.4f}",
                     "yes" if ratio >= args.target else "no"])
    print(table(["change", "best interval, steps", "lost s / fault", "goodput", f">= {args.target:.1%}"], rows))


if __name__ == "__main__":
    main()
