"""The product on one machine: a TrainingRun trains for real, breaks halfway, and comes back.

  python -m localcluster.demo [--fault kill-rank|node-not-ready|neuron-error|hang|evict] [--steps N]

Starts the local control plane with three process-backed nodes, the operator, and applies
examples/tiny-local-run.yaml (2 nodes x 2 ranks). Prints the run's progress every two seconds,
injects the fault halfway, shows detection, restart and resume, then the goodput with the lost
seconds by phase next to the trainer's own clock. Everything it started is stopped at the end
and on Ctrl-C. Run through ``bash tools/demo``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import warnings
from pathlib import Path

import yaml

from . import drill
from .cluster import Cluster, free_base_port

STATE = Path.home() / ".cache/trainium-operator/demo-cluster"
WORK = Path("/tmp/trainium-local")


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def line(d: drill.Drill, t0: float) -> str:
    st = d.status()
    ckpt = (st.get("lastCheckpoint") or {}).get("step")
    gp = (st.get("goodput") or {}).get("effectiveRatio")
    loss = st.get("loss")
    return (f"  t={time.time() - t0:5.1f}s  phase {st.get('phase', '-'):10s} attempt {st.get('attempt', '-')}  "
            f"step {st.get('step', '-'):>4}  loss {loss if loss is None else f'{loss:.3f}'}  "
            f"restarts {st.get('restartCount', 0)}  checkpoint {ckpt}  goodput {gp}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/demo", description=__doc__.split("\n")[0])
    ap.add_argument("--fault", default="kill-rank", choices=[f for f in drill.FAULTS if f != "operator-kill"])
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")

    def interrupted(signum, frame):  # a closed terminal or a kill stops everything too, like Ctrl-C
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    from trainer.data import tinydata

    say(f"generating the offline corpus and tokenizer in {WORK / 'data'}, and tokenizing it into token shards "
        f"(python -m trainer.data.prepare) so each rank reads only its rows (once)")
    data = tinydata.ensure(str(WORK / "data"))
    body = yaml.safe_load(drill.EXAMPLE.read_text())
    body["spec"]["training"]["steps"] = args.steps
    body["spec"]["data"] = {**body["spec"]["data"], "tokenizer": data["tokenizer"],
                            "sources": [{"uri": data["stories_prepared"], "weight": 3},
                                        {"uri": data["facts_prepared"], "weight": 1}]}
    d_ckpt, d_losses = Path(body["spec"]["checkpoint"]["uri"]), Path(body["spec"]["logging"]["lossesFile"])
    for old in (d_ckpt, d_losses):  # a fresh run each time
        if old.is_dir():
            import shutil
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()

    cluster = Cluster(state_dir=STATE, base_port=free_base_port(start=27000))
    operator = None
    try:
        say("starting the local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok, pod runner)")
        cluster.up()
        cluster.kubectl("apply", "-f", str(drill.ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.wait_established("trainingruns.trainium.dev")
        nodes = drill.process_nodes(cluster, 3, "demo-")
        say(f"3 process-backed cpu nodes Ready: {', '.join(nodes)} (their pods run as real processes)")
        operator = drill.Operator(cluster, STATE / "operator.log")
        operator.start()
        say(f"operator started (log {STATE / 'operator.log'})")
        d = drill.Drill(cluster, "default", body)
        say(f"kubectl apply -f {drill.EXAMPLE.relative_to(drill.ROOT)}  ({args.steps} steps, TP 2 x DP 2 on 2 pods, "
            f"checkpoint every {body['spec']['checkpoint']['intervalSteps']} steps)")
        t0 = time.time()
        d.create()
        every = body["spec"]["checkpoint"]["intervalSteps"]
        fault_step = args.steps // 2 + every // 2  # between two checkpoints: some steps are lost
        fault_time = failed_step = None
        last_print = 0.0
        seen_failures = 0
        while True:
            st = d.status()
            failures = st.get("failures") or []
            for f in failures[seen_failures:]:
                say(f"operator: {f['cause']} failure detected ({f['message']}); action {f['action']}"
                    + (f"; quarantined {f['node']}" if f["node"] in (st.get("quarantinedNodes") or []) else ""))
                seen_failures += 1
            if time.monotonic() - last_print >= 2:
                print(line(d, t0), flush=True)
                last_print = time.monotonic()
            if fault_time is None and d.trained_step() >= fault_step:
                failed_step, fault_time = d.trained_step(), time.time()
                hit = d.inject(args.fault, operator)
                say(f"FAULT: {args.fault} on {hit} at step {failed_step}")
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            if time.time() - t0 > 900:
                say("the run did not finish in 15 minutes; stopping")
                return 1
            time.sleep(0.2)
        print(line(d, t0), flush=True)
        st = d.status()
        say(f"run {st['phase']}: {st.get('message')}")
        if fault_time is not None:
            tl = drill.timeline(d, fault_time, failed_step)
            rel = (lambda t: f"+{t - fault_time:5.1f}s" if t else "   n/a")
            kind = ((st.get("failures") or [{}])[-1]).get("restart")
            how = {"inPlace": "in place: new workers in the same pods, no pod deleted or created",
                   "replace": "the failed pod alone replaced, the others in place",
                   "recreate": "the gang recreated: every pod deleted and created again"}.get(kind, kind or "n/a")
            say(f"recovery, from the fault (restarted {how}):")
            print(f"    detected by the operator        {rel(tl.detected)}")
            print(f"    new gang running                {rel(tl.gang_running)}")
            print(f"    first new step                  {rel(tl.first_step)}   (resumed from the checkpoint at step {tl.resumed_step})")
            print(f"    back at step {failed_step:<4}               {rel(tl.caught_up)}")
        gp = st.get("goodput") or {}
        truth = drill.ground_truth(d.losses_path, st["createdTime"])
        lost = gp.get("lostSeconds") or {}
        say(f"goodput (effective training ratio) {gp.get('effectiveRatio')}: {gp.get('productiveSeconds')}s productive "
            f"of {gp.get('wallSeconds')}s; lost: detect {lost.get('detect')}s, teardown {lost.get('teardown')}s, "
            f"schedule {lost.get('schedule')}s (the first start included), restore {lost.get('restore')}s, "
            f"recompute {lost.get('recompute')}s")
        say(f"the trainer's own clock says {truth.ratio:.3f} ({truth.productive_seconds:.1f}s of {truth.wall_seconds:.1f}s; "
            f"{truth.executions - len(truth.losses)} steps trained twice)")
        return 0 if st["phase"] == "Succeeded" else 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        say("stopping the operator, the pods and the control plane")
        if operator:
            operator.stop()
        cluster.down(keep_state=True)
        drill.kill_leftovers(cluster.pods_dir)


if __name__ == "__main__":
    sys.exit(main())
