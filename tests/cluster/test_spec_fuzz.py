"""A thousand fuzzed specs (tests/specgen.py) against the real API server with the operator
running: each is refused by the API server with a message naming a spec field, or accepted and
then either planned by the operator (Valid, one pod per node) or refused by it (Valid=False,
the field named, no pod). The operator never crashes and does not keep rewriting a refused run."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import HealthCheck, given, settings

from tests import specgen

from .test_operator import GROUP, PLURAL, VERSION  # noqa: F401  (fixtures below come from there)
from .test_operator import crd, custom, operator  # noqa: F401

pytestmark = pytest.mark.cluster

EXAMPLES = 1000
BATCH = 40
API_FIELD = re.compile(r"spec\.[A-Za-z]")


def test_fuzzed_specs_are_planned_or_refused_naming_the_field(local_cluster, core_api, operator, custom,  # noqa: F811
                                                              namespace):
    from kubernetes.client.exceptions import ApiException
    counts = {"api": 0, "operator": 0, "planned": 0}
    pending: list[tuple[str, dict]] = []
    seq = iter(range(10 ** 6))

    def settle(batch: list[tuple[str, dict]]) -> None:
        """Wait for the operator's decision on each run of the batch, check it, delete the batch."""
        deadline = time.monotonic() + 120
        decided: dict[str, dict] = {}
        while len(decided) < len(batch):
            for name, _ in batch:
                if name in decided:
                    continue
                st = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name).get("status") or {}
                valid = next((c for c in st.get("conditions") or [] if c["type"] == "Valid"), None)
                if valid and (valid["status"] == "False" or st.get("attempt")):
                    decided[name] = st
            assert time.monotonic() < deadline, f"no decision for {[n for n, _ in batch if n not in decided]}"
            time.sleep(0.2)
        def pods_by_run() -> dict[str, int]:
            out: dict[str, int] = {}
            for p in core_api.list_namespaced_pod(namespace).items:
                run = (p.metadata.labels or {}).get("trainium.dev/run")
                out[run] = out.get(run, 0) + 1
            return out
        # status records the attempt before its pods are created: wait for the planned pods
        want = {name: (0 if spec.get("suspend") is True else spec["nodes"]) for name, spec in batch
                if next(c for c in decided[name]["conditions"] if c["type"] == "Valid")["status"] == "True"}
        by_run = pods_by_run()  # read once even when the whole batch was refused (want is empty)
        while any(by_run.get(n, 0) != k for n, k in want.items()):
            assert time.monotonic() < deadline, {n: (by_run.get(n, 0), k) for n, k in want.items()}
            time.sleep(0.2)
            by_run = pods_by_run()
            for n in [n for n, k in want.items() if by_run.get(n, 0) != k]:
                # pods the API server refuses (a fuzzed serviceAccountName that does not exist):
                # the run says why, and waits (the pods come once the account exists)
                st = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, n).get("status") or {}
                refused = next((c for c in st.get("conditions") or [] if c["type"] == "ChildrenCreated"
                                and c["status"] == "False"), None)
                if refused is not None:
                    assert refused["message"], st
                    want[n] = by_run.get(n, 0)
        refused_versions = {}
        for name, spec in batch:
            st = decided[name]
            valid = next(c for c in st["conditions"] if c["type"] == "Valid")
            if valid["status"] == "False":
                counts["operator"] += 1
                assert re.match(r"spec(\.[A-Za-z_]\w*(\[\d+\])?)*: ", valid["message"]), (spec, valid["message"])
                assert st["phase"] == "Failed" and by_run.get(name, 0) == 0, (spec, st)
                refused_versions[name] = custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name)["metadata"]["resourceVersion"]
            else:
                counts["planned"] += 1
                assert st["attempt"] == 1 and st["worldSize"] > 0, (spec, st)
                assert by_run.get(name, 0) == want[name], (spec, by_run.get(name))
        # a refused run must not be rewritten again and again: checked when the next batch has
        # settled (many passes later, with no sleep of its own), then deleted
        check_unchanged(time.monotonic())
        watched.update((name, (version, time.monotonic())) for name, version in refused_versions.items())
        for name, _ in batch:
            if name not in refused_versions:
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        assert operator["proc"].poll() is None, "the operator must survive every spec"

    watched: dict[str, tuple[str, float]] = {}  # refused runs: resourceVersion, and when it was read

    def check_unchanged(now: float) -> None:
        for name, (version, at) in list(watched.items()):
            if now - at < 1.5:  # two ticks at least
                continue
            current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            assert current["metadata"]["resourceVersion"] == version, f"{name} keeps being rewritten"
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            del watched[name]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(specgen.specs())
    def apply(spec):
        name = f"fz-{next(seq):04d}"
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingRun", "metadata": {"name": name}, "spec": spec}
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict")
        except ApiException as exc:
            assert exc.status in (400, 422), (spec, exc.status, exc.body)
            assert API_FIELD.search(exc.body or ""), (spec, exc.body)
            counts["api"] += 1
            return
        pending.append((name, spec))
        if len(pending) >= BATCH:
            settle(list(pending))
            pending.clear()

    started = time.monotonic()
    apply()
    if pending:
        settle(pending)
    time.sleep(1.5)
    check_unchanged(time.monotonic())
    assert not watched
    total = sum(counts.values())
    print(f"\nfuzzed specs: {total} applied in {time.monotonic() - started:.0f}s: refused by the API server "
          f"{counts['api']}, by the operator {counts['operator']}, planned {counts['planned']}")
    assert total >= EXAMPLES * 0.95 and min(counts.values()) > 30, counts
