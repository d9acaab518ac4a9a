"""A reconcile pass (run_pass.Pass) built from a few named pieces, for the policy modules'
table tests: a spec, the status as read, pods and nodes as typed views."""

from __future__ import annotations

from trainium_api.agent import Report
from trainium_api.load import lenient
from trainium_api.status import TrainingRunStatus
from trainium_operator.disruption_guard import DisruptionGuard
from trainium_operator.effects import DeletePod, Event, OrderPod, Quarantine
from trainium_operator.observe import NodeView, PodView
from trainium_operator.reconcile import working_copy
from trainium_operator.run_pass import Pass
from trainium_operator.spec import parse

SPEC = {"image": "img", "nodes": 2, "instanceType": "cpu", "processesPerNode": 2,
        "model": {"preset": "tiny"}, "parallelism": {"tensor": 2},
        "training": {"steps": 100, "globalBatchSize": 4, "microBatchSize": 2, "seqLen": 16},
        "data": {"sources": [{"uri": "/data", "weight": 1.0}], "tokenizer": "/data/tokenizer.json"},
        "checkpoint": {"uri": "/ckpt", "intervalSteps": 5}}
NOW = 1000.0


def spec_with(**fault_tolerance) -> dict:
    return {**SPEC, "faultTolerance": fault_tolerance}


def node(name: str, ready: str = "True", taints: tuple[str, ...] = (), uid: str = "", provider_id: str = "") -> NodeView:
    return NodeView(name, ready, set(taints), uid=uid or f"uid-{name}", provider_id=provider_id)


def nodes(*names: str) -> dict[str, NodeView]:
    return {n: node(n) for n in names}


def pod(index: int, attempt: int = 1, phase: str = "Running", node_name: str | None = None, agent: Report | None = None,
        **kw) -> PodView:
    return PodView(f"r-a{attempt}-{index}", attempt, index, phase, f"n{index}" if node_name is None else node_name,
                   kw.pop("deleting", False), agent=agent, **kw)


def make_pass(status: dict | None = None, pods: list[PodView] = (), node_views: dict[str, NodeView] | None = None,
              now: float = NOW, spec: dict | None = None, spares: list[PodView] = (), **kw) -> Pass:
    old = lenient(TrainingRunStatus, status or {})
    new = working_copy(old)
    run = {"metadata": {"name": "r", "namespace": "ns", "uid": "u-1", "generation": 1}, "spec": spec or SPEC,
           "status": status or {}}
    return Pass(run, parse(spec or SPEC), old, new, list(pods), nodes("n0", "n1") if node_views is None else node_views,
                now, None, "", DisruptionGuard(), None, spares=list(spares), **kw)


def events(p: Pass) -> list[str]:
    return [e.reason for e in p.effects if isinstance(e, Event)]


def deletes(p: Pass) -> list[tuple[str, int]]:
    return [(e.name, e.grace) for e in p.effects if isinstance(e, DeletePod)]


def orders(p: Pass) -> list[str]:
    return [e.name for e in p.effects if isinstance(e, OrderPod)]


def taints(p: Pass) -> list[str]:
    return [e.name for e in p.effects if isinstance(e, Quarantine)]
