"""How far a spec and a failed pod walk through the operator, in modules (issue 42).

    python tools/walks.py

  spec        the modules of ours whose functions are handed a TrainingRun's spec (its raw
              object or what is parsed from it) while it becomes the snapshot a pass decides
              on (observer.snapshot: parse, default, check, derive)
  failed pod  the modules of ours whose functions are handed the failed pod (its raw object,
              its PodView) or the failure found in it, from the pod's API object through the
              passes that detect it, tear the attempt down and start the next one; counted
              twice: handed alone, and handed alone or in a list of pods

  hand-offs   in the pass that finds the failure, each call reconcile.py makes to another
              module handing it the failure or what is decided about it

Counted with sys.setprofile on real calls, so the figure follows the code, not a reading.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "api"), str(ROOT / "operator")]

OURS = ("trainium_operator", "trainium_api")


def _ours(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.split(".")[0] in OURS else None


def _profiled(fn, profile) -> None:
    """Run ``fn`` with ``profile`` called on every Python call, and no profile after."""
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)


def _holds(value, marks: list, depth: int = 2) -> bool:
    if any(value is m for m in marks):
        return True
    if depth and isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds(v, marks, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds(v, marks, depth - 1) for v in value.values())
    return False


def modules_handed(fn, marks: list, grows=lambda value: False, depth: int = 2) -> set[str]:
    """Modules whose functions get one of ``marks`` (or a value ``grows`` says is made from
    one: the failure found in the pod, its record) among their arguments."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        name = _ours(frame)
        if not name:
            return
        code = frame.f_code
        for var in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            value = frame.f_locals.get(var)
            if value is None:
                continue
            if grows(value) and not any(value is m for m in marks):
                marks.append(value)
            if _holds(value, marks, depth):
                seen.add(name)
                break

    _profiled(fn, profile)
    return seen


def _raw_pod(i: int, attempt: int = 1, failed: bool = False) -> dict:
    """Pod ``i`` of ``attempt`` as the API server holds it: at step 50, running, or its trainer
    exited 1."""
    from trainium_api import keys
    status = ({"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}
              if failed else {"phase": "Running"})
    return {"metadata": {"name": f"r-a{attempt}-{i}", "labels": {keys.ATTEMPT: str(attempt), keys.INDEX: str(i)},
                         "annotations": {keys.PROGRESS: '{"step": 50, "time": 990.0}'}},
            "spec": {"nodeName": f"n{i}"}, "status": status}


def _running_run() -> dict:
    """Run r (tests.unit.test_operator_core.RUN: 4 nodes) with attempt 1 running."""
    from tests.unit.test_operator_core import RUN
    run = copy.deepcopy(RUN)
    run["status"] = {"phase": "Running", "attempt": 1, "createdTime": 0.0, "runningSince": 100.0,
                     "conditions": [{"type": "Valid", "status": "True"}]}
    return run


def spec_walk() -> set[str]:
    """A new run's spec, from its raw object to the spec the pass decides on."""
    from trainium_operator import observer
    from trainium_operator.observer import snapshot
    from tests.unit.test_operator_core import RUN
    run = copy.deepcopy(RUN)
    marks: list = [run, run["spec"]]
    observer._parsed_text.cache_clear()  # a spec seen before is not parsed again

    def grows(value) -> bool:  # what is parsed from it: the typed spec and its groups, and its
        # raw object as dict or as JSON text (a parse cache keys on the text)
        module = type(value).__module__
        return (module.startswith("trainium_api.spec") or type(value).__name__ in ("TrainingRunSpec", "Layout")
                or (isinstance(value, dict) and "nodes" in value and "image" in value)
                or (isinstance(value, str) and value.startswith("{") and '"nodes"' in value))

    return modules_handed(lambda: snapshot(run, [], {}, 10.0), marks, grows)


def failed_pod_walk(depth: int = 2) -> set[str]:
    """Attempt 1 runs on 4 nodes; pod 2's trainer exits 1. Passes until attempt 2 starts."""
    from trainium_operator.observe import pod_view
    from trainium_operator.reconcile import reconcile_objects
    from trainium_api import keys
    from tests.unit.test_operator_core import _node

    raw_failed = _raw_pod(2, failed=True)
    marks: list = [raw_failed]

    def grows(value) -> bool:  # the failure found in the pod and what records it
        kind = type(value).__name__
        return kind in ("Failure", "FailureRecord", "Verdict") or (
            getattr(value, "name", None) == "r-a1-2" and kind == "PodView")

    walked: list[str] = []

    def walk() -> None:
        def pod(i: int, attempt: int = 1):
            return pod_view(_raw_pod(i, attempt))

        nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
        run = _running_run()
        pods = [pod(0), pod(1), pod_view(raw_failed), pod(3)]
        now = 1000.0
        for _ in range(8):  # detect, tear down, start the next attempt
            result = reconcile_objects(run, pods, nodes, now)
            run = {**run, "status": {**run["status"], **result.status}}
            deleted = {e.name for e in result.effects if e.kind == "delete_pod"}
            pods = [p for p in pods if p.name not in deleted]
            made = [m for m in result.ensured("Pod") if m["metadata"]["name"] not in {p.name for p in pods}]
            if made and not pods:
                pods = [pod(int(m["metadata"]["labels"][keys.INDEX]), int(m["metadata"]["labels"][keys.ATTEMPT]))
                        for m in made]
                walked.append("started")
                break
            now += 5.0

    seen = modules_handed(walk, marks, grows, depth)
    assert walked, "the walk never reached the next attempt: tools/walks.py no longer matches the pass"
    return seen


def hand_offs_from_the_pass() -> list[str]:
    """In the pass that finds pod 2 failed: each call that reconcile.py makes to another module
    handing it the failure (or what is decided about it), as "caller -> callee"."""
    from trainium_operator.observe import pod_view
    from trainium_operator.reconcile import reconcile_objects
    from tests.unit.test_operator_core import _node

    run = _running_run()
    pods = [pod_view(_raw_pod(i, failed=i == 2)) for i in range(4)]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    kinds = ("Failure", "FailureRecord", "Verdict", "Action")
    calls: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not _ours(frame) or frame.f_back is None:
            return
        caller = frame.f_back.f_globals.get("__name__", "")
        if caller != "trainium_operator.reconcile" or _ours(frame) == caller:
            return
        code = frame.f_code
        for var in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            if type(frame.f_locals.get(var)).__name__ in kinds:
                calls.append(f"{frame.f_back.f_code.co_name} -> {_ours(frame)}.{code.co_name}")
                break

    _profiled(lambda: reconcile_objects(run, pods, nodes, 1000.0), profile)
    return calls


def main() -> int:
    spec, failed, alone = sorted(spec_walk()), sorted(failed_pod_walk()), sorted(failed_pod_walk(depth=0))
    print(f"spec: {len(spec)} modules: {' '.join(spec)}")
    print(f"failed pod (alone or in a list of pods): {len(failed)} modules: {' '.join(failed)}")
    print(f"failed pod (alone): {len(alone)} modules: {' '.join(alone)}")
    hand_offs = hand_offs_from_the_pass()
    print(f"hand-offs of the failure out of reconcile.py in the detecting pass: {len(hand_offs)}: "
          + "; ".join(hand_offs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
