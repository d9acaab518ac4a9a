"""The failure judge's rules as a table (judge.judge): one row per rule and per hold, each with
the cause it must find or the hold it must give, over plain pods and nodes. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from tests.unit.test_operator_core import SPEC
from trainium_api.status import Disruption
from trainium_operator.judge import Clocks, Guards, Observed, judge
from trainium_operator.observe import gang_state, node_view, pod_view
from trainium_operator.disruption_guard import DisruptionGuard
from trainium_operator.spec import parse

NOW = 10_000.0
GUARD = DisruptionGuard(settle_seconds=10, device_settle_seconds=30, outage_min_seconds=10, outage_grace_seconds=60,
                        max_hold_seconds=900, culprit_wait_seconds=5)
HBM = ("neuron-runtime-fault: device NRT_EXEC_HW_ERR_HBM_UE local-rank -\n(FATAL-RT-UNDEFINED-STATE) Uncorrectable HBM "
       "memory error is detected. Execution results may be invalid.")
PEER = "neuron-runtime-fault: peer PEER_CLOSED local-rank -\nConnection closed by peer [10.0.0.2]:29500"
NUMERICAL = "neuron-runtime-fault: restart NRT_EXEC_COMPLETED_WITH_NUM_ERR local-rank 3\nstatus NRT_EXEC_COMPLETED_WITH_NUM_ERR"


def pod(i: int, phase: str = "Running", step: int | None = 50, code: int | None = None, reason: str = "",
        node: str | None = "", deleting: bool = False, waiting: str = "", scheduled_ago: float = 500.0,
        term: str = "", finished_ago: float = 1.0) -> dict:
    status: dict = {"phase": phase}
    if reason:
        status["reason"] = reason
    if code is not None:
        status["containerStatuses"] = [{"state": {"terminated": {"exitCode": code, "reason": "Error", "message": term,
                                                                 "finishedAt": NOW - finished_ago}}}]
    if waiting:
        status["containerStatuses"] = [{"state": {"waiting": {"reason": waiting, "message": "secret x not found"}}}]
    status["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": NOW - scheduled_ago}]
    meta = {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)},
            "creationTimestamp": NOW - 700}
    if step is not None:
        meta["annotations"] = {"trainium.dev/progress": f'{{"step": {step}, "time": {NOW - 1}}}'}
    if deleting:
        meta["deletionTimestamp"] = NOW - 1
    return {"metadata": meta, "spec": {"nodeName": f"n{i}" if node == "" else node}, "status": status}


def node(i: int, ready: str = "True", changed_ago: float = 1000.0, neuron_error: str = "", alloc: int = 16,
         short_for: float | None = None, agent: tuple[str, str | None] | None = None) -> dict:
    """``agent``: (condition type, the Fatal reason the EKS node monitoring agent wrote; None: healthy)."""
    conds = [{"type": "Ready", "status": ready, "lastTransitionTime": NOW - changed_ago}]
    if agent:
        kind, reason = agent
        conds.append({"type": kind, "status": "True" if reason is None else "False", "reason": reason or "IsReady",
                      "message": "Discovered HBM Uncorrectable Error", "lastTransitionTime": NOW - changed_ago})
    if neuron_error:
        conds.append({"type": "NeuronHealth", "status": "True", "reason": neuron_error,
                      "lastTransitionTime": NOW - changed_ago})
    return {"metadata": {"name": f"n{i}"}, "status": {"conditions": conds,
            "capacity": {"aws.amazon.com/neuron": "16"}, "allocatable": {"aws.amazon.com/neuron": str(alloc)}},
            "_short_for": short_for}


@dataclass
class Row:
    name: str
    pods: dict[int, dict] = field(default_factory=dict)  # index -> pod(...) override
    nodes: dict[int, dict] = field(default_factory=dict)
    clocks: dict = field(default_factory=dict)
    guards: dict = field(default_factory=dict)
    missing: int = 0  # pods never created
    cause: str | None = None
    fatal: bool = False
    hold: str = ""  # a word the hold's reason must contain ("" = no hold)
    disruption: bool = False  # a disruption in force after the pass
    node: str | None = None  # the node the failure names, when the row says


RUNNING = {"gang_running_time": NOW - 300, "last_step_time": NOW - 5, "step_seconds": 1.0}
ROWS = [
    Row("healthy"),
    Row("fatal exit wins over a node signal", pods={0: pod(0, "Failed", code=78)}, nodes={1: node(1, "False")},
        cause="application", fatal=True),
    Row("node NotReady while the gang runs on settles: it may be a mass event's first",
        nodes={2: node(2, "False", changed_ago=1)}, hold="mass event"),
    Row("node NotReady whose rank died acts at once", nodes={2: node(2, "False", changed_ago=1)},
        pods={0: pod(0, "Failed", code=1)}, cause="node", node="n2"),
    Row("node NotReady with a pod gone acts at once", nodes={2: node(2, "False", changed_ago=1)}, missing=1,
        cause="node"),
    Row("node NotReady past the settle time", nodes={2: node(2, "False", changed_ago=11)}, cause="node"),
    Row("node Unknown settles first", nodes={2: node(2, "Unknown", changed_ago=3)}, hold="disruption"),
    Row("node Unknown past the settle time", nodes={2: node(2, "Unknown", changed_ago=30)}, cause="node"),
    Row("node deleted", nodes={3: None}, cause="node"),
    Row("NeuronHealth error", nodes={1: node(1, neuron_error="NeuronHasError_DMA_ERROR")}, cause="neuron-device"),
    Row("the EKS node monitoring agent: AcceleratedHardwareReady False", cause="neuron-device", node="n1",
        nodes={1: node(1, agent=("AcceleratedHardwareReady", "NeuronHBMUncorrectableError"))}),
    Row("the agent's hardware condition True is healthy", nodes={1: node(1, agent=("AcceleratedHardwareReady", None))}),
    Row("the agent: NetworkingReady False is the node's fault", cause="node", node="n2",
        nodes={2: node(2, agent=("NetworkingReady", "InterfaceNotUp"))}),
    Row("the agent's node fault on a NotReady node is not held as a mass event's", cause="node", node="n2",
        nodes={2: node(2, "False", changed_ago=1, agent=("ContainerRuntimeReady", "PodStuckTerminating"))}),
    Row("devices missing briefly: a device-plugin restart", nodes={1: node(1, alloc=0, short_for=5)},
        hold="device-plugin"),
    Row("devices missing past the settle time", nodes={1: node(1, alloc=12, short_for=31)}, cause="neuron-device"),
    Row("a settling device does not hide a crash", nodes={1: node(1, alloc=0, short_for=5)},
        pods={2: pod(2, "Failed", code=1)}, cause="application"),
    Row("crashed rank", pods={3: pod(3, "Failed", code=1)}, cause="application"),
    Row("a store that stayed unavailable past the pod's retries: its own cause, not the job's",
        pods={3: pod(3, "Failed", code=75, term="store-unavailable: read s3://b/tok.json failed 10 times over 290 s: "
                                                  "SlowDown (HTTP 503)")}, cause="store"),
    Row("exit 75 without that word is a crash", pods={3: pod(3, "Failed", code=75)}, cause="application"),
    Row("that word with another exit code is a crash", pods={3: pod(3, "Failed", code=1, term="store-unavailable: x")},
        cause="application"),
    Row("the runtime names a hardware fault: that pod's node, though a peer's pod failed first",
        pods={0: pod(0, "Failed", code=1, term=PEER, finished_ago=3), 2: pod(2, "Failed", code=1, term=HBM)},
        cause="neuron-device", node="n2"),
    Row("a pod that only lost a peer waits for the pod that caused it",
        pods={0: pod(0, "Failed", code=1, term=PEER, finished_ago=2)}, hold="caused"),
    Row("past the culprit wait, the pod that lost its peer is blamed",
        pods={0: pod(0, "Failed", code=1, term=PEER, finished_ago=6)}, cause="application", node="n0"),
    Row("a plain crash is blamed before a pod that lost its peer",
        pods={0: pod(0, "Failed", code=1, term=PEER), 1: pod(1, "Failed", code=1)}, cause="application", node="n1"),
    Row("every pod lost a peer and none still runs: no wait",
        pods={i: pod(i, "Failed", code=1, term=PEER) for i in range(4)}, cause="application", node="n0"),
    Row("the runtime asks only for a new process: a crash, the node kept",
        pods={1: pod(1, "Failed", code=1, term=NUMERICAL)}, cause="application", node="n1"),
    Row("a fault message with an unknown status is a plain crash",
        pods={1: pod(1, "Failed", code=1, term=HBM.replace("NRT_EXEC_HW_ERR_HBM_UE", "NRT_MADE_UP"))},
        cause="application"),
    Row("evicted pod: its own reason wins over its exit code", pods={3: pod(3, "Failed", code=137, reason="Evicted")},
        cause="eviction"),
    Row("evicted pod that exited 0 did not succeed", pods={3: pod(3, "Failed", code=0, reason="Evicted")},
        cause="eviction"),
    Row("drained pod: the DisruptionTarget condition wins over its exit code",
        pods={3: {**pod(3, "Failed", code=143), "status": {**pod(3, "Failed", code=143)["status"], "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]}}},
        cause="eviction"),
    Row("pod deleted from outside", pods={1: pod(1, deleting=True)}, cause="eviction"),
    Row("pod missing", missing=1, clocks=RUNNING, cause="eviction"),
    Row("hang: no step change for the timeout", clocks={**RUNNING, "last_step_time": NOW - 700}, cause="hang"),
    Row("no hang while steps move", clocks=RUNNING),
    Row("no first step within the startup timeout",
        pods={i: pod(i, step=None) for i in range(4)}, clocks={"gang_running_time": NOW - 4000, "last_step_time": None},
        cause="hang"),
    Row("hang: a rank stuck after the others finished",
        pods={i: pod(i, "Succeeded", code=0) for i in range(3)}, clocks={**RUNNING, "last_step_time": NOW - 700},
        cause="hang"),
    Row("no first step: the startup clock restarts at an outage's end",
        pods={i: pod(i, step=None) for i in range(4)}, clocks={"gang_running_time": NOW - 4000, "last_step_time": None},
        guards={"api_outage": (NOW - 100, NOW - 20)}),
    Row("hang clock restarts at an outage's end", clocks={**RUNNING, "last_step_time": NOW - 700},
        guards={"api_outage": (NOW - 100, NOW - 20)}),
    Row("a blip shorter than the outage minimum does not restart it", clocks={**RUNNING, "last_step_time": NOW - 700},
        guards={"api_outage": (NOW - 25, NOW - 20)}, cause="hang"),
    Row("node Unknown around an API outage is held",
        nodes={2: node(2, "Unknown", changed_ago=40)}, guards={"api_outage": (NOW - 100, NOW - 50)}, hold="outage"),
    Row("pod placed but not started past the startup timeout",
        pods={0: pod(0, "Pending", step=None, waiting="CreateContainerConfigError", scheduled_ago=3700)},
        cause="startup"),
    Row("pod placed but not started, within the startup timeout",
        pods={0: pod(0, "Pending", step=None, waiting="ImagePullBackOff", scheduled_ago=10)}),
    Row("pods unscheduled past the schedule timeout",
        pods={0: pod(0, "Pending", step=None, node=None)}, cause="scheduling"),
    Row("pods the API server would not create, past the schedule timeout", missing=2,
        clocks={"attempt_start_time": NOW - 1000}, guards={"children_error": "exceeded quota"}, cause="scheduling"),
    Row("pods the API server would not create, within it", missing=2, clocks={"attempt_start_time": NOW - 5}),
    Row("a disruption holds a lost node", nodes={i: node(i, "Unknown", changed_ago=30) for i in range(3)},
        guards={"disruption": "3 of 4 nodes are NotReady or Unknown"}, hold="disruption", disruption=True),
    Row("a disruption holds a hang", clocks={**RUNNING, "last_step_time": NOW - 700},
        guards={"disruption": "zone down"}, hold="disruption", disruption=True),
    Row("a disruption does not hold a crash", pods={3: pod(3, "Failed", code=1)},
        guards={"disruption": "zone down"}, cause="application", disruption=True),
    Row("a disruption held past its maximum lets the failure through",
        nodes={2: node(2, "Unknown", changed_ago=1000)},
        clocks={"disruption": Disruption(since=NOW - 901, message="zone down")}, guards={"disruption": "zone down"},
        cause="node", disruption=True),
    Row("a disruption's end restarts the hang clock",
        clocks={**RUNNING, "last_step_time": NOW - 700, "disruption": Disruption(since=NOW - 100, message="x")},
        hold="hang clock"),
    Row("a disruption lasts while a node of its wave is not back",
        nodes={1: node(1, "Unknown", changed_ago=100)},
        clocks={"disruption": Disruption(since=NOW - 105, message="zone down")}, hold="disruption", disruption=True),
    Row("a mass event holds missing devices past their settle time", nodes={1: node(1, alloc=0, short_for=200)},
        guards={"disruption": "40 of 64 nodes turned missing Neuron devices within 120s"}, hold="disruption",
        disruption=True),
    Row("a mass event holds a NotReady node past its settle time", nodes={1: node(1, "False", changed_ago=30)},
        guards={"disruption": "9 of 20 nodes turned NotReady within 120s"}, hold="disruption", disruption=True),
    Row("a mass event does not hold a hardware condition",
        nodes={1: node(1, neuron_error="NeuronHasError_DMA_ERROR")},
        guards={"disruption": "40 of 64 nodes turned missing Neuron devices within 120s"}, cause="neuron-device",
        disruption=True),
    Row("a mass event lasts while a node of its wave misses devices",
        nodes={1: node(1, alloc=0, short_for=100)},
        clocks={"disruption": Disruption(since=NOW - 105, message="mass")}, hold="disruption", disruption=True),
    Row("a quarantined node does not keep a disruption open",
        nodes={1: node(1, "Unknown", changed_ago=100)},
        clocks={"disruption": Disruption(since=NOW - 105, message="zone down"), "quarantined": ("n1",)},
        cause="node"),
]


def node_views(overrides: dict[int, dict | None]) -> dict:
    """The four nodes n0..n3 as the judge sees them, with ``overrides`` by index (None: deleted);
    a node's ``_short_for`` is how long its devices have been missing (the observer's memory)."""
    nodes = {}
    for i in range(4):
        raw = overrides.get(i, node(i))
        if raw is None:
            continue
        view = node_view(raw)
        if raw.get("_short_for") is not None:
            view = replace(view, neuron_short_since=NOW - raw["_short_for"])
        nodes[view.name] = view
    return nodes


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_judge(row: Row):
    pods = [pod_view(row.pods.get(i, pod(i))) for i in range(4 - row.missing)]
    nodes = node_views(row.nodes)
    guards = dict(row.guards)
    children_error = guards.pop("children_error", "")
    clocks = {**RUNNING, **row.clocks} if row.clocks is not RUNNING else RUNNING
    seen = Observed(parse(SPEC), gang_state(pods), nodes, NOW, gang_complete=not (row.missing and
                    "attempt_start_time" in row.clocks), children_error=children_error)
    verdict = judge(seen, Clocks(**clocks), Guards(GUARD, **guards))
    assert (verdict.failure.cause if verdict.failure else None) == row.cause, verdict
    if row.cause:
        assert verdict.failure.fatal == row.fatal and verdict.failure.message
    if row.node is not None:
        assert verdict.failure.node == row.node, verdict.failure
    assert (row.hold in verdict.hold.reason if row.hold else verdict.hold is None or row.cause), verdict.hold
    assert (verdict.disruption is not None) == row.disruption, verdict.disruption


def test_the_judge_is_the_only_place_that_finds_failures():
    """No other operator module decides "is this a failure now?" (issue 22: there were five)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "operator" / "trainium_operator"
    deciders = [p.name for p in root.glob("*.py") if re.search(r"\bFailure\(", p.read_text()) and p.name not in ("judge.py",)]
    assert deciders == [], deciders


def test_device_shortfalls_remember_since_when_a_node_is_short():
    """The node object carries no time for its allocatable count: the observer remembers when it
    first saw the shortfall, keeps that time while it lasts, and forgets it once the node is whole."""
    from trainium_operator.observer import DeviceShortfalls
    memory, short, whole = DeviceShortfalls(), node_view(node(1, alloc=0)), node_view(node(1))
    assert memory.mark({"n1": short}, 100.0)["n1"].neuron_short_since == 100.0
    assert memory.mark({"n1": short}, 130.0)["n1"].neuron_short_since == 100.0
    assert memory.mark({"n1": whole}, 140.0)["n1"].neuron_short_since is None
    assert memory.mark({"n1": short}, 150.0)["n1"].neuron_short_since == 150.0  # a new shortfall settles anew
    # a node no pass looked at for a while (the run moved off it before it was whole): a
    # shortfall seen days later is new, not one that has lasted for days
    assert memory.mark({"n1": short}, 150.0 + 86_400)["n1"].neuron_short_since == 150.0 + 86_400
