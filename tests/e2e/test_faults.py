"""End to end (tier e2e): kubectl-style apply -> the operator (a real process) -> pods running the
real trainer as local processes (2 nodes x 2 ranks, TP 2 x DP 2) -> one real fault -> the run
ends Succeeded, trained exactly as if nothing had happened.

For every fault the test checks, from the trainer's and the machine's own records:
- the per-step losses and gradient norms equal an uninterrupted run of the same spec, bitwise;
- every resume loaded the newest checkpoint that was complete when its pod started (so never a
  torn tag);
- a quarantined node never ran a pod again;
- processes of two attempts never ran at once (a sampler of the process table);
- the goodput in the run's status is within 2 points of the ground truth computed from the
  trainer's step end times.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from localcluster import drill, podprocs
from localcluster.drill import Drill, ProcessSampler

pytestmark = pytest.mark.e2e

STEPS = 40
FAULT_AT = 18  # steps trained before the fault (checkpoints every 5: step 15 is complete by then)
CHECKPOINT_EVERY = 5
# (the Neuron node problem detector's NeuronHealth, "neuron-error", is the cluster tier's: here
# the EKS node monitoring agent's AcceleratedHardwareReady stands for the node conditions)
CAUSE = {"kill-rank": "application", "node-not-ready": "node", "node-deleted": "node",
         "accelerated-hardware": "neuron-device", "runtime-fault": "neuron-device", "runtime-restart": "application",
         "straggler": "straggler", "hang": "hang", "operator-kill": "application", "evict": "eviction",
         "agent-frozen": "application", "spot-interruption": "eviction"}
QUARANTINES = ("node-not-ready", "accelerated-hardware")  # (a deleted node has nothing to taint)
VOLUNTARY = ("evict", "spot-interruption")  # the cluster's doing: restarted, no budget spent
AVOIDS = ("runtime-fault", "straggler")  # the run's own pods named the node: it avoids it, no taint
IN_PLACE = ("kill-rank", "hang", "operator-kill", "runtime-restart")  # the nodes stay trusted: new workers in the same pods
# one pod's node is left out or its pod is gone: that pod alone is replaced, the other restarts in place
REPLACED = ("node-not-ready", "node-deleted", "accelerated-hardware", "runtime-fault", "straggler", "evict",
            "spot-interruption")


def spec_for(name: str, tiny_data, workdir):
    return drill.manifest(name, tiny_data, workdir,
                          training={"steps": STEPS},
                          checkpoint={"intervalSteps": CHECKPOINT_EVERY, "keep": 100},
                          logging={"interval": 5, "progressIntervalSeconds": 1})


def finish(d: Drill, timeout: float = 300) -> dict:
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, timeout, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    return st


@pytest.fixture(scope="module")
def reference(e2e, tiny_data, tmp_path_factory):
    """The same spec with no fault: its losses are what every faulted run must reproduce."""
    ns = e2e.namespace("reference")
    d = Drill(e2e.cluster, ns, spec_for("ref", tiny_data, tmp_path_factory.mktemp("reference")))
    d.create()
    st = finish(d)
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    print(f"\nreference: {STEPS} steps, median step {truth.step_seconds:.3f}s, goodput status "
          f"{st['goodput']['effectiveRatio']:.3f} vs truth {truth.ratio:.3f}")
    assert sorted(truth.losses) == list(range(1, STEPS + 1))
    assert truth.executions == STEPS and not st.get("failures")
    reference_goodput[:] = [st["goodput"]["effectiveRatio"], truth.ratio]
    return truth


reference_goodput: list[float] = []


def test_uninterrupted_run_succeeds_and_reports_true_goodput(reference):
    status_ratio, true_ratio = reference_goodput
    assert abs(status_ratio - true_ratio) <= 0.02


@pytest.mark.parametrize("fault", [f for f in CAUSE if f not in ("node-deleted", "agent-frozen")])  # (those below)
def test_fault_is_survived_with_exact_resume(e2e, reference, tiny_data, tmp_path, fault):
    body = spec_for("tiny", tiny_data, tmp_path)
    if fault == "hang":
        body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "hangTimeoutFloorSeconds": 8}
    if fault == "straggler":  # pod 0's workers get a third of the time (a slow node)
        body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "stragglers": "replace",
                                          "stragglerReports": 3}
    survive(e2e, reference, e2e.namespace(fault), drill.fitted(body, fault), fault)


@pytest.fixture(scope="module")
def pipeline_reference(e2e, tiny_data, tmp_path_factory):
    """The pipeline spec with no fault (PP 2 x DP 2 reproduces a TP 2 x DP 2 run only within
    float tolerance, so it gets its own bitwise reference)."""
    d = Drill(e2e.cluster, e2e.namespace("pp-reference"),
              pipeline_spec("ppref", tiny_data, tmp_path_factory.mktemp("pp-reference")))
    d.create()
    st = finish(d)
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    assert sorted(truth.losses) == list(range(1, STEPS + 1)) and not st.get("failures")
    return truth


def pipeline_spec(name: str, tiny_data, workdir):
    """Two pipeline stages (layers 0-1 on node 0's ranks' stage, 2-3 on the other) x DP 2."""
    body = spec_for(name, tiny_data, workdir)
    body["spec"]["parallelism"] = {"tensor": 1, "pipeline": 2, "zero1": True}
    return body


def test_pipeline_run_survives_a_killed_rank_with_exact_resume(e2e, pipeline_reference, tiny_data, tmp_path):
    """A rank of a PP 2 x DP 2 gang is SIGKILLed under the operator: the gang restarts, every
    stage resumes from its own pp_rank shards of the newest complete checkpoint, and the run
    reproduces its uninterrupted losses bitwise."""
    survive(e2e, pipeline_reference, e2e.namespace("pipeline"), pipeline_spec("pp", tiny_data, tmp_path),
            "kill-rank")


@pytest.mark.s3
def test_checkpoints_on_s3_with_credentials_from_a_secret(e2e, reference, tiny_data, tmp_path):
    """The same drill with checkpoints on the loopback S3 server: the pods get the endpoint
    through spec.env and the credentials from a Secret (valueFrom.secretKeyRef)."""
    ns = e2e.namespace("s3")
    e2e.s3.client.create_bucket(Bucket="ckpt-e2e")
    e2e.core.create_namespaced_secret(ns, {"metadata": {"name": "s3-credentials"},
                                           "stringData": {"id": "testing", "secret": "testing"}})
    body = spec_for("tiny", tiny_data, tmp_path)
    body["spec"]["checkpoint"]["uri"] = "s3://ckpt-e2e/tiny"
    body["spec"]["env"] = [
        {"name": "AWS_ENDPOINT_URL", "value": e2e.s3.endpoint},
        {"name": "FSSPEC_S3_ENDPOINT_URL", "value": e2e.s3.endpoint},
        {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"},
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": "id"}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": "secret"}}}]
    survive(e2e, reference, ns, body, "kill-rank")
    assert 5 in drill.complete_steps("s3://ckpt-e2e/tiny")


def test_a_replaced_node_restores_from_its_peers_memory(e2e, reference, tiny_data, tmp_path):
    """checkpoint.memory peers (ZeRO-1: every data rank keeps its own state): each node also
    holds a copy of the next node's. Pod 0's node goes NotReady; pod 0 alone is replaced on a
    third node, whose memory is empty: its ranks read their state from pod 1's node (the peer's
    copy), pod 1's from its own memory, and the run trains on bitwise as if nothing happened."""
    body = spec_for("peer", tiny_data, tmp_path)
    body["spec"]["checkpoint"] = {**body["spec"]["checkpoint"], "memory": "peers"}
    # the memory tier changes no training: the uninterrupted run is the reference
    survive(e2e, reference, e2e.namespace("peer-restore"), body, "node-not-ready", source="peer")


@pytest.mark.parametrize("fault", ["node-not-ready", "node-deleted"])
def test_a_lost_node_is_replaced_by_a_warm_spare_while_the_other_pod_restarts_in_place(e2e, reference, tiny_data,
                                                                                      tmp_path, fault):
    """faultTolerance.spares 1: a standby pod waits on the third node. Pod 0's node goes
    NotReady (its pod is forced after the teardown grace: a NotReady node may still run it), or
    is deleted (the instance terminated: its pod is forced at once); the spare takes index 0
    (node rank 0 and the rendezvous address: its own hostname), pod 1 restarts in place, and no
    pod is started for the gang; the run trains on bitwise as if nothing happened. A new spare
    is requested (no node is left for it here)."""
    body = spec_for("warm", tiny_data, tmp_path)
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "spares": 1}
    survive(e2e, reference, e2e.namespace(f"spare-{fault}"), body, fault, spare=True)


def test_an_agent_that_does_not_answer_has_the_gang_recreated(e2e, reference, tiny_data, tmp_path):
    """Pod 0's agent is frozen (SIGSTOP), then a rank of pod 1 crashes: the operator orders the
    gang to stop in place, pod 0's agent never answers, and once the teardown grace (3 s here)
    and inplace.ANSWER_SLACK_SECONDS have passed the gang is recreated: both pods deleted (pod
    0's processes killed with its namespace after the grace), and a new gang resumes from the
    newest checkpoint and trains on bitwise as if nothing happened."""
    body = spec_for("frozen", tiny_data, tmp_path)
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "teardownGraceSeconds": 3}
    ns = e2e.namespace("agent-frozen")
    survive(e2e, reference, ns, body, "agent-frozen")
    given_up = [e.message for e in e2e.core.list_namespaced_event(ns).items if e.reason == "InPlaceRestartGivenUp"]
    assert len(given_up) == 1 and "not every agent said its workers stopped within 18s" in given_up[0], given_up


def survive(e2e, reference: drill.Truth, ns: str, body: dict, fault: str, source: str | None = None,
            spare: bool = False) -> None:
    """Run ``body``, inject ``fault`` after FAULT_AT steps, and check everything the run must
    have done right (see the module docstring). ``source``: where the restart must restore
    from (else memory in place, store when the gang or a pod is new); ``spare``: the run has a
    warm spare, which must take the replaced pod's place."""
    name = body["metadata"]["name"]
    d = Drill(e2e.cluster, ns, body)
    with ProcessSampler(ns, name) as sampler:
        d.create()
        d.wait_step(FAULT_AT, 240)
        if spare:
            d.wait(lambda: d.status().get("spares") == [f"{name}-spare-1"], 120, "the spare to wait at the ready")
        if fault in IN_PLACE:  # the agents park the next attempt's launcher a few seconds into this one
            d.wait(lambda: all(podprocs.parked_pids(podprocs.live_init_pid(podprocs.latest_pod_dir(
                e2e.cluster.pods_dir, ns, p.metadata.name))) for p in d.pods()), 60, "warm launchers to be parked")
        failed_step, fault_time = d.trained_step(), time.time()
        hit = d.inject(fault, e2e.operator)
        st = finish(d)
    tl = drill.timeline(d, fault_time, failed_step)
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    gp = st["goodput"]
    print(f"\n{fault}: hit {hit}; failed at step {failed_step}; resumed from step {tl.resumed_step}; "
          f"detected +{(tl.detected or 0) - fault_time:.2f}s, gang running +{(tl.gang_running or 0) - fault_time:.2f}s, "
          f"first new step +{(tl.first_step or 0) - fault_time:.2f}s, back at step {failed_step} "
          f"+{(tl.caught_up or 0) - fault_time:.2f}s; goodput status {gp['effectiveRatio']:.3f} vs truth "
          f"{truth.ratio:.3f}; lost {gp['lostSeconds']}\n  status: stepSeconds {st.get('stepSeconds')}, first "
          f"progress {st.get('firstProgressTime')} after {st.get('firstProgressSteps')} steps; failure {st['failures'][-1]}; "
          f"trainer: median step {truth.step_seconds:.3f}s, productive {truth.productive_seconds:.1f}s of "
          f"{truth.wall_seconds:.1f}s")

    # the trainer's first step end dates each start exactly, even one the operator saw late
    # (operator-kill: the new gang trains before the operator is back)
    assert st.get("firstProgressSteps") == 1 and st["failures"][-1].get("resumedSteps") == 1, st
    # the operator saw the right failure, once, for the right reason
    assert st["restarts"] == {CAUSE[fault]: 1}, st["restarts"]
    reason = {"runtime-fault": "NRT_EXEC_HW_ERR_HBM_UE", "straggler": "is a straggler",
              "runtime-restart": "NRT_EXEC_COMPLETED_WITH_NUM_ERR"}.get(fault, "")
    assert reason in st["failures"][-1]["message"], st["failures"][-1]
    # an eviction through the API, a Spot interruption: the cluster's doing, restarted, no budget spent
    assert st["failures"][-1].get("exempt") == ("voluntary" if fault in VOLUNTARY else None), st["failures"][-1]
    if fault == "spot-interruption":
        # acted on at the notice, not at the node's end: the gang stopped at a save of the step
        # it was on, so it recomputes no step trained before the notice (the bound: 0 steps), and
        # it had moved before EC2 reclaimed the node (drill.SPOT_NOTICE_SECONDS after the notice)
        assert tl.resumed_step >= failed_step, (tl.resumed_step, failed_step)
        assert "is to be terminated (karpenter.sh/disrupted taint)" in st["failures"][-1]["message"]
        assert (tl.first_step or 0) - fault_time < drill.SPOT_NOTICE_SECONDS, tl
        for end in d.terminations:
            end.wait(drill.SPOT_NOTICE_SECONDS + 30)
            assert end.deleted_at is not None
    # bitwise: every step's loss and gradient norm as in the uninterrupted run
    assert sorted(truth.losses) == sorted(reference.losses)
    for step, rec in reference.losses.items():
        got = truth.losses[step]
        assert (got["loss"], got["gradNorm"]) == (rec["loss"], rec["gradNorm"]), f"step {step}"
    # every resume loaded the newest checkpoint that was complete when its pod started, and
    # training went on from the step after it
    resumes = drill.resumes(e2e.cluster.pods_dir, ns, name)
    assert resumes, "the restarted gang did not resume from a checkpoint"
    assert drill.restart_points(d.losses_path) == [r["step"] for r in resumes], resumes
    complete = drill.complete_steps(d.ckpt_uri)
    for r in resumes:
        assert r["step"] == drill.newest_complete_before(d.ckpt_uri, r["started"]), r
        assert r["step"] in complete
    # quarantined nodes never ran a pod again
    records = [r for r in drill.podprocs.all_records(e2e.cluster.pods_dir) if r["namespace"] == ns]
    if fault in QUARANTINES + AVOIDS:
        kept_out = st.get("quarantinedNodes") if fault in QUARANTINES else [a["node"] for a in st.get("avoidedNodes", [])]
        assert kept_out == [hit], st
        assert not [r["name"] for r in records if r["node"] == hit and r["created"] > fault_time]
    # restarted in place (no pod created after the fault) when the nodes stayed trusted; else
    # only the pod hit (index 0) replaced, the other restarted in place
    kind = "inPlace" if fault in IN_PLACE else "replace" if fault in REPLACED else "recreate"
    assert st["failures"][-1].get("restart") == kind, st["failures"][-1]
    created = sorted({r["name"] for r in records if r["created"] > fault_time})
    if fault in IN_PLACE:
        assert st.get("restartsInPlace") == 1, st
        assert not created, "an in-place restart created pods"
        # the new workers came from the parked launchers (trainer.pod.warm), forked, not started cold
        assert sampler.warm == {2}, sampler.warm
    if fault in REPLACED:
        took = f"{name}-spare-1" if spare else f"{name}-a2-0"
        assert st.get("restartsReplaced") == 1 and st["current"]["podNames"] == [took, f"{name}-a1-1"], st
        # (the new spare finds no node here until the gang ends)
        assert [n for n in created if "-spare-" not in n] == ([] if spare else [took]), created
    if fault in IN_PLACE + REPLACED:
        gang_ordered(d, name, st)
    if fault not in QUARANTINES:
        assert not st.get("quarantinedNodes")
    if fault not in AVOIDS:
        assert not st.get("avoidedNodes")
    if getattr(d, "slowed", None):
        d.slowed.stop()
    # processes of two attempts never ran at once
    assert not sampler.overlaps, sampler.overlaps[:3]
    spans = sorted(sampler.seen.items())
    assert len(spans) == st["attempt"] == 2, spans
    assert spans[0][1][1] < spans[1][1][0]
    # the operator's goodput against the trainer's own clock
    assert abs(gp["effectiveRatio"] - truth.ratio) <= 0.02, (gp, truth)
    # the steps after the checkpoint the run resumed from were counted by their own time: the
    # failed attempt's trainer saved that step and said when it ended (its step log's time)
    failure = st["failures"][-1]
    if failure.get("checkpointStep") == failure.get("resumedStep") and failure.get("checkpointStep"):
        # (the gang's newest of its pods' reports: the ranks end a step within a collective's time)
        ended = truth_step_end(d, failure["checkpointStep"], fault_time)
        assert ended is not None and abs(failure.get("checkpointTime", 0) - ended) < 0.25, (failure, ended)
    # the restarted attempt said what reading and loading its checkpoint took: its own phase
    # (the tiny model restores in hundredths of a second: 0.0 once rounded is a report too)
    assert st["current"].get("restoreSeconds") is not None, st["current"]
    assert st["current"]["restoreSeconds"] == st.get("restoreSeconds", 0.0), st
    assert gp["lostSeconds"]["restore"] == round(st.get("restoreSeconds", 0.0), 1), gp
    # where it read from: an in-place restart keeps the pods and their memory (checkpoint.memory),
    # a new pod has none and reads the store (the slowest rank's source is the run's)
    assert st["current"].get("restoreSource") == (source or ("memory" if fault in IN_PLACE else "store")), st["current"]


def truth_step_end(d: Drill, step: int, before: float) -> float | None:
    """When the attempt that failed at ``before`` ended ``step``, by the trainer's step log."""
    ends = [r["time"] for r in drill.read_losses(d.losses_path) if r["step"] == step and r["time"] < before]
    return ends[-1] if ends else None


def gang_ordered(d: Drill, name: str, st: dict) -> None:
    """The restart went through one order for the gang (trainium_api.gangorder): the run's order
    object says attempt 2 started in the gang's pods, every agent said it reads it, and no
    order was written on a pod."""
    from trainium_api import agent, gangorder, keys
    held = d.core.read_namespaced_config_map(gangorder.object_name(name), d.ns)
    order = gangorder.parse(held.data[gangorder.DATA_KEY])
    assert order is not None and (order.order.attempt, order.order.start) == (st["attempt"], True), order
    assert order.names(name) == st["current"]["podNames"] or (
        not st["current"].get("podNames") and order.names(name) == [f"{name}-a1-{i}" for i in range(2)]), order
    for pod in d.pods():
        if pod.metadata.name in order.names(name):
            ann = pod.metadata.annotations or {}
            assert keys.ORDER not in ann, (pod.metadata.name, ann.get(keys.ORDER))
            assert agent.parse_report(ann.get(keys.AGENT_REPORT)).gang_orders, pod.metadata.name


def test_a_gang_cut_off_from_the_control_plane_is_fenced_by_the_next_attempt(e2e, tiny_data, tmp_path):
    """The node of a one-pod gang (2 ranks, TP 2) is partitioned: its kubelet and the trainer
    live on, training and saving, hearing of no deletion, while the operator quarantines the node
    and starts attempt 2 elsewhere. Attempt 2's rank 0 raises its fence in the checkpoint store
    before it picks where to resume; attempt 1's next save sees the fence, writes no marker,
    deletes nothing, and its gang stops. Then: no tag was completed by attempt 1 after the fence,
    attempt 2 resumed from a tag completed before it, and every step both gangs trained has the
    same loss and gradient norm bitwise (attempt 1 is the uninterrupted run up to where it was
    fenced)."""
    from localcluster import faults
    from trainium_api import checkpoints
    body = spec_for("cutoff", tiny_data, tmp_path)
    body["spec"]["nodes"] = 1
    # never reached: attempt 1 must outlive the failover (about 40 s), and the test ends once
    # attempt 2 has trained past where attempt 1 was fenced
    body["spec"]["training"] = {**body["spec"]["training"], "steps": 2000}
    d = Drill(e2e.cluster, e2e.namespace("cut-off"), body)
    d.create()
    d.wait_step(FAULT_AT, 240)
    node = d.running_pod(0).spec.node_name
    faults.node_partition(e2e.core, node)
    d.note("partitioned")

    def cut_off_log() -> str:
        return "".join((Path(r["dir"]) / drill.podprocs.LOG).read_text(errors="replace")
                       for r in drill.podprocs.all_records(e2e.cluster.pods_dir)
                       if r.get("namespace") == d.ns and r["name"] == "cutoff-a1-0"
                       and (Path(r["dir"]) / drill.podprocs.LOG).exists())

    def by_attempt() -> tuple[dict, dict]:
        records = drill.read_losses(d.losses_path)
        return ({r["step"]: r for r in records if r.get("startStep", 0) == 0},
                {r["step"]: r for r in records if r.get("startStep", 0) > 0})

    def past_the_fence() -> bool:
        old, new = by_attempt()
        return bool(new) and max(new) > max(old) and "fenced by attempt 2: stopping after step" in cut_off_log()
    d.wait(past_the_fence, 300, "attempt 2 to train past where the cut-off attempt 1 was fenced")
    st = d.status()
    assert st["attempt"] == 2 and st["restarts"] == {"node": 1} and st["quarantinedNodes"] == [node], st
    old, new = by_attempt()
    resumed = min(new) - 1
    epochs = checkpoints.fences(d.ckpt_uri)
    assert [e[1] for e in epochs] == [1, 2]
    tags = [t for t in checkpoints.list_tags(d.ckpt_uri) if t.complete]
    late = [t.tag for t in tags if checkpoints.completed_after_fence(d.ckpt_uri, t, epochs)]
    print(f"\ncut off: attempt 1 trained to step {max(old)}, fenced; attempt 2 resumed at step {resumed}, now at "
          f"{max(new)}; complete tags {[(t.step, t.attempt) for t in tags]}; late done markers {late}")
    assert not late
    resumed_tag = next(t for t in tags if t.step == resumed)  # a complete tag, and one from before the fence
    assert resumed_tag.attempt == 1 and resumed_tag.tag not in late
    both = sorted(set(old) & set(new))
    assert both and max(old) > resumed, (max(old), resumed)  # attempt 1 trained on past the resume point
    for step in both:
        assert (old[step]["loss"], old[step]["gradNorm"]) == (new[step]["loss"], new[step]["gradNorm"]), step
    assert sorted(new) == list(range(resumed + 1, max(new) + 1))
    d.custom.delete_namespaced_custom_object(drill.GROUP, drill.VERSION, d.ns, drill.PLURAL, d.name)
    d.wait(lambda: not d.pods(), 60, "the run's pods to go with it")


def test_a_node_whose_rank_hangs_in_the_preflight_check_is_left_out(e2e, reference, tiny_data, tmp_path):
    """faultTolerance.preflight on: pod 0's check rank is frozen (SIGSTOP) while it times its
    matmuls, so every other rank would wait in the next collective until the check's timeout.
    Its own launcher sees the rank's heartbeat go stale, names its node (cause preflight); the
    run avoids that node, starts on the others and trains exactly as the reference (bitwise)."""
    import os
    import signal

    from localcluster import faults, podprocs
    body = spec_for("hung", tiny_data, tmp_path)
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "preflight": "on",
                                      "preflightTimeoutSeconds": 30}
    d = Drill(e2e.cluster, e2e.namespace("preflight-hang"), body)
    d.create()

    def computing():
        try:
            workers = podprocs.worker_pids(podprocs.live_init_pid(podprocs.latest_pod_dir(
                e2e.cluster.pods_dir, d.ns, "hung-a1-0")))
        except (LookupError, OSError):
            return None
        pid = faults.preflight_rank_in(workers.values(), "compute")
        # the first check rank found in the compute stage; pod 0 has node rank 0 (plan.py), so its
        # global ranks are its local ranks
        return pid and (next(r for r, p in workers.items() if p == pid), pid)
    local_rank, frozen = d.wait(computing, 180, "pod 0's check rank to time its matmuls", interval=0.05)
    os.kill(frozen, signal.SIGSTOP)
    node = d.core.read_namespaced_pod("hung-a1-0", d.ns).spec.node_name
    try:
        st = finish(d)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    failure = st["failures"][-1]
    print(f"\npreflight hang: {failure['message']}")
    assert st["restarts"] == {"preflight": 1} and failure["cause"] == "preflight" and failure["node"] == node, st
    assert f"local rank {local_rank} stopped responding (no heartbeat for" in failure["message"], failure
    assert [a["node"] for a in st["avoidedNodes"]] == [node] and not st.get("quarantinedNodes")
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    assert sorted(truth.losses) == sorted(reference.losses)
    for step, rec in reference.losses.items():
        assert (truth.losses[step]["loss"], truth.losses[step]["gradNorm"]) == (rec["loss"], rec["gradNorm"]), step


def test_a_slow_node_is_found_by_the_preflight_check_and_the_run_starts_on_the_others(e2e, reference, tiny_data,
                                                                                       tmp_path):
    """faultTolerance.preflight on: pod 0's node is slowed from the pod's start (every process of
    the pod gets a tenth of the time), so the check before training names it (cause preflight);
    the run avoids that node, starts again on the others and trains exactly as the reference
    (bitwise); the check's seconds are goodput's preflight phase."""
    from localcluster import faults
    body = spec_for("pre", tiny_data, tmp_path)
    body["spec"]["faultTolerance"] = {**body["spec"]["faultTolerance"], "preflight": "on", "preflightSlowFactor": 3}
    d = Drill(e2e.cluster, e2e.namespace("preflight"), body)
    d.create()

    def started():
        try:
            return faults.SlowPod(e2e.cluster.pods_dir, d.ns, "pre-a1-0", share=0.1, whole=True)
        except (LookupError, OSError):
            return None
    slowed = d.wait(started, 120, "pod 0 of attempt 1 to start its processes", interval=0.05)
    node = d.core.read_namespaced_pod("pre-a1-0", d.ns).spec.node_name
    try:
        st = finish(d)
    finally:
        slowed.stop()
    failure = st["failures"][-1]
    print(f"\npreflight: {failure['message']}; goodput {st['goodput']}")
    assert st["restarts"] == {"preflight": 1} and failure["cause"] == "preflight" and failure["node"] == node, st
    assert [a["node"] for a in st["avoidedNodes"]] == [node] and not st.get("quarantinedNodes")
    assert st["goodput"]["lostSeconds"]["preflight"] > 0 and st["preflightSeconds"] > 0
    # the run showed its Preflight phase while a check ran (the pods' launchers said so)
    shown = [e.message for e in e2e.core.list_namespaced_event(d.ns).items if e.reason == "Preflight"]
    assert shown and "pre-flight check of the gang's" in shown[0], shown
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    assert sorted(truth.losses) == sorted(reference.losses)
    for step, rec in reference.losses.items():
        assert (truth.losses[step]["loss"], truth.losses[step]["gradNorm"]) == (rec["loss"], rec["gradNorm"]), step


TRAINER_IMAGE = "localhost/trainium-trainer-cpu:local"  # tools/images trainer-cpu
CONTAINER_POOL = {"example.com/pool": "containers"}  # the test's own container-backed nodes


def claim(core, ns: str, name: str, path: Path) -> dict:
    """A PersistentVolumeClaim bound to a hostPath PersistentVolume at ``path``: the local stand-in
    for an FSx for Lustre claim (a shared file system, mounted by every pod, invisible to the
    operator's own pod)."""
    pv = f"{ns}-{name}"
    core.create_persistent_volume({"metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
        "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)}}})
    core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": name}, "spec": {
        "accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
        "resources": {"requests": {"storage": "1Gi"}}}})
    deadline = time.monotonic() + 60  # bound first: the scheduler backs off a pod with an unbound claim
    while core.read_namespaced_persistent_volume_claim(name, ns).status.phase != "Bound":
        assert time.monotonic() < deadline, f"claim {name} not bound"
        time.sleep(0.1)
    return {"name": name, "persistentVolumeClaim": {"claimName": name}}


def test_killed_rank_on_container_nodes_is_survived_in_place(e2e, reference, tiny_data, tmp_path):
    """The demo's fault with the trainer pods run from the trainer-cpu image (tools/images) on
    container-backed nodes (localcluster/podcontainer.py: podman, the image's own files, Python
    and user 65532): a rank SIGKILLed, the run restarted in place from the pods' memory, trained
    bitwise as the uninterrupted run (on this machine's environment), and everything else
    ``survive`` checks. The data, checkpoints and step log are on claims of a shared file system,
    as on EKS with FSx; the operator (its own container) sees none of them."""
    import os
    import subprocess

    from localcluster.nodes import create_nodes
    built = subprocess.run(["bash", str(drill.ROOT / "tools" / "images"), "trainer-cpu"], capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    core = e2e.core
    nodes = create_nodes(core, 2, "cpu", "faults-", containers=True)
    pvs = []
    try:
        for node in nodes:
            core.patch_node(node, {"metadata": {"labels": CONTAINER_POOL}})
        drill.wait_ready(core, nodes)
        ns = e2e.namespace("containers")
        os.chmod(tmp_path, 0o777)  # the image's user writes there (an FSx volume's root is the user's)
        data_root = Path(os.path.commonpath(list(tiny_data.values())))
        body = drill.fitted(spec_for("tiny", tiny_data, tmp_path), "kill-rank")
        body["spec"].update(image=TRAINER_IMAGE, podTemplate={"spec": {"nodeSelector": CONTAINER_POOL}},
                            volumes=[claim(core, ns, "data", data_root), claim(core, ns, "work", tmp_path)],
                            volumeMounts=[{"name": "data", "mountPath": str(data_root), "readOnly": True},
                                          {"name": "work", "mountPath": str(tmp_path)}])
        pvs = [f"{ns}-data", f"{ns}-work"]
        survive(e2e, reference, ns, body, "kill-rank")
        # the pods ran from the image: podman's containers, their Python the image's
        pods_dir = e2e.cluster.pods_dir
        records = [r for r in podprocs.all_records(pods_dir) if r["namespace"] == ns]
        assert records and all(r["container"] and r["node"] in nodes for r in records), records
        # its user wrote the checkpoints and the step log (the image's 65532, not this machine's root)
        owners = {p.stat().st_uid for p in [*Path(body["spec"]["checkpoint"]["uri"]).rglob("*"),
                                            Path(body["spec"]["logging"]["lossesFile"])]}
        assert owners == {65532}, owners
    finally:
        for node in nodes:
            core.delete_node(node)
        for pv in pvs:
            with contextlib.suppress(Exception):
                core.delete_persistent_volume(pv)
