"""Recovery end to end, per fault kind: the operator and pods running the real trainer on the
local control plane (process-backed nodes), 2 nodes x 2 ranks (TP 2 x DP 2).

    python bench/e2e_recovery.py [--faults kill-rank,node-not-ready,...] [--steps 40] [--fault-at 18]
                                 [--restart both|warm|all|in-place|cold|spare|recreate]

For each fault: fault injected -> detected by the operator -> every pod of the new gang running
-> the first new step -> back at the step of the failure, from the trainer's own step times;
the seconds lost (trainer's clock) next to the operator's lost seconds by phase and its goodput.
The peer is the same run without a fault, measured in the same session: the table's last
column is the faulted run's wall time over the uninterrupted run's. With ``--restart both``
(the default) every fault runs twice, with in-place restarts (faultTolerance.inPlaceRestarts,
the default) and with the gang recreated (inPlaceRestarts 0, the peer of the second table),
and the second table compares fault -> first new step between the two, as a ratio. ``all`` adds
in place with cold workers (TRAINER_WARM_WORKERS=0 in spec.env: every restart starts its
launcher and workers as new interpreters, as before trainer.pod.warm) and in place with one warm
spare (faultTolerance.spares 1: a lost node's pod index goes to a standby pod already running);
``warm`` runs in place with warm and with cold workers, and recreated. Everything started is
stopped at the end, on Ctrl-C and on errors.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench.common import stop_cleanly_on_signals, table  # noqa: E402
from localcluster import drill  # noqa: E402
from localcluster.cluster import Cluster, free_base_port  # noqa: E402


NODES, NODE_PREFIX = 3, "bench-"  # two for the gang, a third for a replacement or a spare
MODES = {"in-place": "in place allowed", "cold": "in place, cold workers (TRAINER_WARM_WORKERS=0)",
         "spare": "in place, 1 warm spare", "recreate": "recreate (inPlaceRestarts 0)"}
PRESETS = {"both": ("in-place", "recreate"), "warm": ("in-place", "cold", "recreate"),
           "all": ("spare", "in-place", "cold", "recreate")}


def one_run(cluster, operator, work: Path, data, name: str, args, fault: str | None, mode: str = "in-place") -> dict:
    from kubernetes import client
    core = client.CoreV1Api(cluster.api_client())
    drill.new_namespace(core, name)
    body = drill.manifest("tiny", data, work / name, training={"steps": args.steps},
                          checkpoint={"intervalSteps": args.checkpoint_every, "keep": 100},
                          logging={"interval": 5, "progressIntervalSeconds": 1})
    if fault == "hang":
        body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "hangTimeoutFloorSeconds": 8}
    if mode == "recreate":
        body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "inPlaceRestarts": 0}
    if mode == "spare":
        body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "spares": 1}
    if mode == "cold":
        from trainium_api.agent import WARM_ENV
        body["spec"]["env"] = [*body["spec"].get("env", []), {"name": WARM_ENV, "value": "0"}]
    d = drill.Drill(cluster, name, drill.fitted(body, fault))
    d.create()
    out: dict = {"fault": fault or "none (peer)"}
    if fault:
        d.wait_step(args.fault_at, 300)
        if mode == "spare":
            d.wait(lambda: d.status().get("spares"), 120, "the spare to wait")
        failed_step, fault_time = d.trained_step(), time.time()
        d.inject(fault, operator)
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 600, "the run to end")
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    gp = st.get("goodput") or {}
    out.update(phase=st["phase"], wall=truth.wall_seconds, truth_ratio=truth.ratio, ratio=gp.get("effectiveRatio"),
               lost=gp.get("lostSeconds") or {}, true_lost=truth.wall_seconds - truth.productive_seconds)
    if fault:
        tl = drill.timeline(d, fault_time, failed_step)
        rel = (lambda t: round(t - fault_time, 2) if t else None)
        out.update(detected=rel(tl.detected), running=rel(tl.gang_running), first=rel(tl.first_step),
                   caught_up=rel(tl.caught_up), resumed=tl.resumed_step, failed_step=failed_step,
                   restart=(st.get("failures") or [{}])[-1].get("restart") or "-")
    drill.heal_process_nodes(core)
    drill.process_nodes(cluster, NODES, NODE_PREFIX)  # a deleted node is registered again
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(drill.FAULTS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-at", type=int, default=18)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--restart", choices=(*PRESETS, *MODES), default="both",
                    help="in-place restarts on (warm workers, the default), on with cold workers, on with one warm "
                         "spare, off (the gang recreated); both: in place and recreated; warm: in place with warm "
                         "and cold workers, and recreated; all: the four")
    args = ap.parse_args()
    modes = PRESETS.get(args.restart, (args.restart,))
    stop_cleanly_on_signals()  # a timed-out or cancelled benchmark still stops its control plane
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    from trainer.data import tinydata
    work = Path(tempfile.mkdtemp(prefix="e2e-recovery-"))
    data = tinydata.ensure(str(work / "data"))
    cluster = Cluster(state_dir=work / "cluster", base_port=free_base_port(start=28000))
    operator = None
    rows = []
    try:
        cluster.up()
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.wait_established("trainingruns.trainium.dev")
        drill.process_nodes(cluster, NODES, NODE_PREFIX)
        operator = drill.Operator(cluster, work / "operator.log")
        operator.start()
        peer = one_run(cluster, operator, work, data, "peer", args, None)
        print(f"peer (no fault): wall {peer['wall']:.1f}s, goodput {peer['ratio']} (trainer {peer['truth_ratio']:.3f})",
              flush=True)
        for i, fault in enumerate(args.faults.split(",")):
            for mode in modes:
                r = one_run(cluster, operator, work, data, f"f{i}-{fault}-{mode}", args, fault, mode)
                r["mode"] = MODES[mode]
                print(f"{fault} ({r['mode']}): {r}", flush=True)
                rows.append(r)
    finally:
        if operator:
            operator.stop()
        cluster.down(keep_state=True)
        drill.kill_leftovers(cluster.pods_dir)
    fmt = (lambda x: "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x))
    print(f"\n{args.steps} steps, fault after step {args.fault_at}, checkpoints every {args.checkpoint_every}; "
          "times in seconds from the fault\n")
    print(table(["fault", "mode", "restart", "detected", "gang running", "first new step", "back at failed step", "resumed at",
                 "lost (trainer)", "lost detect/teardown/schedule/recompute (operator)", "goodput operator",
                 "goodput trainer", "wall / peer wall"],
                [[r["fault"], r["mode"], r["restart"], fmt(r["detected"]), fmt(r["running"]), fmt(r["first"]), fmt(r["caught_up"]),
                  f"{r['resumed']} (failed {r['failed_step']})", fmt(r["true_lost"] - peer["true_lost"]),
                  "/".join(fmt(r["lost"].get(k)) for k in ("detect", "teardown", "schedule", "recompute")),
                  f"{r['ratio']:.3f}", f"{r['truth_ratio']:.3f}", fmt(r["wall"] / peer["wall"])] for r in rows]))
    print("\nlost (trainer): seconds lost to the fault by the trainer's clock, beyond the peer's own start-up")
    if len(modes) > 1 and modes[-1] == "recreate":
        k = len(modes)
        print("\nfault -> first new step, against the same fault with the gang recreated (same session)\n")
        print(table(["fault", "mode", "restart done", "first new step", "recreated: first new step", "ratio"],
                    [[a["fault"], a["mode"], a["restart"], fmt(a["first"]), fmt(b["first"]),
                      fmt(a["first"] / b["first"]) if a["first"] and b["first"] else "-"]
                     for group in (rows[j:j + k] for j in range(0, len(rows), k)) for a in group[:-1]
                     for b in group[-1:]]))
    if "in-place" in modes and "cold" in modes:
        warm, cold = MODES["in-place"], MODES["cold"]
        pairs = [(a, b) for a in rows for b in rows if a["fault"] == b["fault"] and a["mode"] == warm
                 and b["mode"] == cold]
        print("\nfault -> first new step, warm workers against cold ones (same session)\n")
        print(table(["fault", "restart (warm)", "warm: first new step", "cold: first new step", "warm / cold"],
                    [[a["fault"], a["restart"], fmt(a["first"]), fmt(b["first"]),
                      fmt(a["first"] / b["first"]) if a["first"] and b["first"] else "-"] for a, b in pairs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
