"""Fuzzed specs through the operator's pure core: every generated spec is either parsed and
planned (one pod per node, each with a command) or refused with a ConfigError naming a spec
field; reconcile never raises on any of them and creates nothing for an invalid one."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings

from tests import specgen
from trainer.config import ConfigError
from trainium_operator import plan
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

FIELD = re.compile(r"spec(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?)*")
SEEN = {"valid": 0, "refused": 0}


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specgen.specs())
def test_every_spec_is_planned_or_refused_naming_a_field(spec):
    run = {"metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec, "status": {}}
    try:
        s = parse(spec)
    except ConfigError as err:
        SEEN["refused"] += 1
        assert FIELD.fullmatch(err.field), err.field
        assert err.message
        r = reconcile_objects(run, [], {}, now=0.0)
        assert r.status["conditions"][0]["status"] == "False" and str(err) in r.status["message"]
        assert not [e for e in r.effects if e.kind == "ensure"]
        return
    SEEN["valid"] += 1
    pods = plan.pods(run, s, 1, [])
    assert len(pods) == s.nodes and all(p["spec"]["containers"][0]["command"] for p in pods)
    r = reconcile_objects(run, [], {}, now=0.0)
    assert sum(e.kind == "ensure" and e.obj["kind"] == "Pod" for e in r.effects) == (0 if s.suspend else s.nodes)


def test_the_fuzz_saw_both_kinds():
    # runs after the fuzz test in file order: both outcomes must have been generated often
    if sum(SEEN.values()):
        assert SEEN["valid"] > 100 and SEEN["refused"] > 100, SEEN
