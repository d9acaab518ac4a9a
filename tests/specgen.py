"""Generated TrainingRun specs, valid and invalid, for the fuzz tests (hypothesis).

Each spec is one of a few valid bases (our trainer on cpu, on trn1; a command trainer) with up
to three mutations: a field of the CRD's schema (walked from trainium_operator.crd, so every
field is reachable) set to a value of any JSON type or one of its enum values, removed, or an
unknown field added. Node counts stay small so that valid runs create few pods.
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st

from trainium_operator import crd

BASES = [
    {"image": "img", "nodes": 2, "instanceType": "cpu", "processesPerNode": 1, "model": {"preset": "tiny"},
     "training": {"seqLen": 128, "globalBatchSize": 8, "microBatchSize": 4, "steps": 10},
     "data": {"sources": [{"uri": "/d/a", "weight": 1}], "tokenizer": "/d/t.json"},
     "checkpoint": {"uri": "/tmp/trainium-operator-tests/fuzz-ckpt", "intervalSteps": 5}},
    {"image": "img", "nodes": 1, "instanceType": "trn1.32xlarge", "model": {"preset": "llama2-7b"},
     "parallelism": {"tensor": 8, "sequenceParallel": True, "zero1": True},
     "training": {"seqLen": 4096, "globalBatchSize": 64, "microBatchSize": 1},
     "data": {"sources": [{"uri": "s3://c/"}], "tokenizer": "s3://c/t.json"},
     "checkpoint": {"uri": "/tmp/trainium-operator-tests/fuzz-ckpt-trn"}},
    {"image": "img", "nodes": 2, "instanceType": "cpu", "processesPerNode": 2,
     "trainer": {"kind": "command", "progressFormat": "nxd", "command": ["train.py", "--steps", "10"]},
     "checkpoint": {"uri": "/tmp/trainium-operator-tests/fuzz-ckpt"}},
]
MAX_NODES = 4


def field_paths(schema: dict, prefix: tuple = ()) -> list[tuple[tuple, dict]]:
    out = []
    for key, sub in (schema.get("properties") or {}).items():
        path = (*prefix, key)
        out.append((path, sub))
        if sub.get("type") == "object":
            out += field_paths(sub, path)
    return out


PATHS = field_paths(crd.spec_schema())
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(-1e3, 1e6, allow_nan=False, width=32),
    st.sampled_from(["", "auto", "x", "10", "-1", "0.5", "nxd", "nxdt", "regex", "command", "builtin", "cpu",
                     "trn1.32xlarge", "neuron", "s3://b/p", "/abs/path", "(?P<step>\\d+", "(?P<step>\\d+)", "iter (\\d+)",
                     "$(CHECKPOINT_URI)", "trainium-trainer", "fsx"]),
    st.text(max_size=6))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.sampled_from(["name", "uri", "x"]),
                                                                          SCALARS, max_size=2))


def _value_for(schema: dict):
    choices = [VALUES]
    if schema.get("enum"):
        choices.append(st.sampled_from(schema["enum"]))
    # values of the right type, which the schema passes and only the operator's checks can refuse
    if schema.get("type") == "integer":
        choices += [st.integers(0, 70)] * 2
    if schema.get("type") == "number":
        choices.append(st.floats(0, 100, allow_nan=False))
    if schema.get("type") == "string":
        choices.append(SCALARS.filter(lambda v: isinstance(v, str)))
    if schema.get("type") == "array" and (schema.get("items") or {}).get("type") == "string":
        choices.append(st.lists(st.sampled_from(["train.py", "--a", "1", "$(NNODES)", ""]), max_size=3))
    return st.one_of(*choices)


_MUTATION = st.one_of(
    st.sampled_from(PATHS).flatmap(lambda ps: st.tuples(st.just(ps[0]), _value_for(ps[1]))),
    st.tuples(st.sampled_from(PATHS).map(lambda ps: ps[0]), st.just("<delete>")),
    st.tuples(st.sampled_from([("bogus",), ("training", "stepz"), ("trainer", "script"), ("checkpoint", "dir")]),
              SCALARS))


# Values the schema accepts and only the operator's checks (layout, backend, contract) can judge.
_SEMANTIC = st.one_of(
    st.tuples(st.just(("parallelism", "tensor")), st.sampled_from([1, 2, 3, 4, 8, 16])),
    st.tuples(st.just(("parallelism", "pipeline")), st.sampled_from([1, 2])),
    st.tuples(st.just(("training", "seqLen")), st.sampled_from([100, 127, 128, 4100])),
    st.tuples(st.just(("training", "globalBatchSize")), st.sampled_from([4, 8, 12, 16, 64])),
    st.tuples(st.just(("processesPerNode",)), st.sampled_from([1, 2, 3, 32, 64])),
    st.tuples(st.just(("backend",)), st.sampled_from(["cpu", "cuda", "neuron", "xla", "auto"])),
    st.tuples(st.just(("faultTolerance", "hangTimeoutSeconds")), st.sampled_from(["soon", "-5", "auto", "30"])),
    st.tuples(st.just(("env",)), st.sampled_from([[{"name": "MASTER_ADDR", "value": "x"}],
                                                   [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}],
                                                   [{"name": "OK", "value": "1"}]])),
    st.tuples(st.just(("trainer", "progressRegex")), st.sampled_from(["(?P<step>\\d+", "it (\\d+)", "(?P<step>\\d+)"])),
    st.tuples(st.just(("compileCache", "precompileSteps")), st.sampled_from([0, 2])))


def _apply(base: dict, mutations: list) -> dict:
    spec = copy.deepcopy(base)
    for path, value in mutations:
        node = spec
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if value == "<delete>":
            node.pop(path[-1], None)
        else:
            node[path[-1]] = copy.deepcopy(value)
    nodes = spec.get("nodes")
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > MAX_NODES:
        spec["nodes"] = nodes % MAX_NODES + 1  # keep valid runs small; invalid counts stay invalid
    return spec


def specs():
    return st.builds(_apply, st.sampled_from(BASES), st.lists(st.one_of(_MUTATION, _SEMANTIC), max_size=3))
