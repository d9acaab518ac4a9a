"""Generate the TrainingRun CustomResourceDefinition from the config dataclasses (one source).

    python -m trainium_operator.crd > crds/trainingruns.trainium.dev.yaml

Field descriptions are the docstrings under each dataclass field. tests/unit/test_crd.py fails
when the committed file differs from what this prints.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap

import yaml

from trainer import ckpt_store, watch
from trainer import config as tcfg

from . import spec as ospec

ENUMS = {
    ("ModelConfig", "preset"): list(tcfg.PRESETS), ("ModelConfig", "family"): ["llama", "neox"],
    ("ParallelConfig", "activation_checkpointing"): ["none", "selective", "full"],
    ("TrainingConfig", "precision"): list(tcfg.PRECISIONS), ("HealthConfig", "nan_policy"): ["skip", "stop"],
    ("TrainerConfig", "kind"): list(ospec.TRAINER_KINDS),
    # "" is the unset default (a builtin trainer has neither)
    ("TrainerConfig", "progress_format"): ["", *watch.PROGRESS_FORMATS],
    ("TrainerConfig", "checkpoint_layout"): ["", *ckpt_store.LAYOUTS],
}
MINIMUM_ONE = {("ParallelConfig", "tensor"), ("ParallelConfig", "pipeline"), ("TrainingConfig", "seq_len"),
               ("TrainingConfig", "global_batch_size"), ("TrainingConfig", "micro_batch_size"),
               ("TrainingConfig", "steps"), ("ModelConfig", "num_layers"), ("ModelConfig", "num_heads")}
NON_NEGATIVE = {("CheckpointConfig", "interval_steps"), ("CheckpointConfig", "keep"),
                ("CheckpointConfig", "interval_minutes"), ("TrainingConfig", "warmup_steps"),
                ("TrainingConfig", "grad_clip"), ("TrainingConfig", "weight_decay"),
                ("TrainerConfig", "tokens_per_sample"), ("TrainerConfig", "samples_per_step")}


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (string literals right after an annotation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


# Groups whose dataclass defaults the API server may fill in. Not the model (a default
# hiddenSize would override a preset's shape) nor data sources (no meaningful default).
DEFAULTED = {"ParallelConfig", "TrainingConfig", "CheckpointConfig", "HealthConfig", "LoggingConfig",
             "FaultToleranceConfig", "RestartBudget", "CompileCacheConfig", "TrainerConfig"}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return value if isinstance(value, list) and value else None
    return None


def schema_for(cls: type) -> dict:
    props = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = tcfg.yaml_key(f.name)
        ann = str(f.type)
        if ann in ("int", "int | None"):
            s: dict = {"type": "integer"}
        elif ann == "float":
            s = {"type": "number"}
        elif ann == "bool":
            s = {"type": "boolean"}
        elif ann == "str":
            s = {"type": "string"}
        elif ann == "list[float]":
            s = {"type": "array", "items": {"type": "number"}}
        elif ann == "list[str]":
            s = {"type": "array", "items": {"type": "string"}}
        elif ann == "list[DataSource]":
            s = {"type": "array", "items": schema_for(tcfg.DataSource)}
            if f.name == "sources":
                s["minItems"] = 1
        else:
            nested = getattr(ospec, ann, None) or getattr(tcfg, ann)
            s = schema_for(nested)
        if ann == "int | None":
            s["nullable"] = True
        if (cls.__name__, f.name) in ENUMS:
            s["enum"] = ENUMS[(cls.__name__, f.name)]
        if (cls.__name__, f.name) in MINIMUM_ONE:
            s["minimum"] = 1
        if (cls.__name__, f.name) in NON_NEGATIVE:
            s["minimum"] = 0
        if cls is ospec.FaultToleranceConfig and f.name == "hang_timeout_seconds":
            s = {"x-kubernetes-int-or-string": True}
        if f.name in docs:
            s["description"] = docs[f.name]
        default = _default(f)
        if cls.__name__ in DEFAULTED and default is not None and not (cls is tcfg.CheckpointConfig and f.name == "uri"):
            s["default"] = default
        props[key] = s
    out = {"type": "object", "properties": props}
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out["description"] = " ".join(cls.__doc__.split())
    return out


_COMMAND = "(has(self.trainer) && has(self.trainer.kind) && self.trainer.kind == 'command')"
RULES = [
    ("has(self.checkpoint) && has(self.checkpoint.uri) && size(self.checkpoint.uri) > 0",
     "checkpoint.uri is required: a restarted gang resumes from it", "spec.checkpoint.uri"),
    (f"!{_COMMAND} || (has(self.trainer.command) && size(self.trainer.command) > 0)",
     "trainer.command is required with trainer.kind command", "spec.trainer.command"),
    (f"!{_COMMAND} || (has(self.trainer.progressFormat) && size(self.trainer.progressFormat) > 0)",
     "trainer.progressFormat is required with trainer.kind command", "spec.trainer.progressFormat"),
    (f"{_COMMAND} || (has(self.data) && has(self.data.sources))",
     "data.sources is required by the builtin trainer", "spec.data.sources"),
    (f"{_COMMAND} || (has(self.data) && has(self.data.tokenizer) && size(self.data.tokenizer) > 0) || (has(self.init) && "
     "has(self.init.from) && size(self.init.from) > 0 && !self.init.from.matches('(^|/)step_[0-9]+/?$'))",
     "data.tokenizer is required (or init.from a Hugging Face directory with a tokenizer)", "spec.data.tokenizer"),
    ("!has(self.training) || !has(self.training.globalBatchSize) || !has(self.training.microBatchSize) || "
     "self.training.globalBatchSize % self.training.microBatchSize == 0",
     "training.globalBatchSize must be a multiple of training.microBatchSize", "spec.training.globalBatchSize"),
    ("!has(self.training) || !has(self.training.lr) || !has(self.training.minLr) || "
     "self.training.minLr <= self.training.lr", "training.minLr must not exceed training.lr", "spec.training.minLr"),
    ("!has(self.parallelism) || !has(self.parallelism.tensor) || !has(self.model) || !has(self.model.numHeads) || "
     "self.model.numHeads % self.parallelism.tensor == 0",
     "parallelism.tensor must divide model.numHeads", "spec.parallelism.tensor"),
]


def spec_schema() -> dict:
    props = {
        "image": {"type": "string", "minLength": 1, "description": "The trainer container image."},
        "nodes": {"type": "integer", "minimum": 1, "description": "Nodes in the gang; one pod per node."},
        "instanceType": {"type": "string", "enum": list(ospec.INSTANCE_TYPES), "default": "trn1.32xlarge",
                         "description": "trn1.32xlarge (16 Neuron devices, 32 cores, 8 EFA), trn1n.32xlarge "
                                        "(16 EFA), or cpu/gpu for development."},
        "processesPerNode": {"type": "integer", "minimum": 1,
                             "description": "Trainer ranks per pod (default: 32 on trn1, 1 on cpu, 8 on gpu)."},
        "suspend": {"type": "boolean", "default": False, "description": "Stop the gang; clearing it resumes from the newest checkpoint."},
        "serviceAccountName": {"type": "string", "description": "ServiceAccount of the trainer pods "
                               "(default trainium-trainer; needs patch on its own pod for progress)."},
        "backend": {"type": "string", "enum": list(tcfg.BACKENDS),
                    "description": "Trainer backend (default: neuron on trn types, cpu otherwise)."},
        "volumes": {"type": "array", "description": "Extra pod volumes (Kubernetes Volume objects: a name and one "
                    "source, e.g. persistentVolumeClaim for a shared file system), mounted with volumeMounts. "
                    f"Names {', '.join(ospec.CONTRACT_VOLUMES)} are the operator's.",
                    "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                              "properties": {"name": {"type": "string", "minLength": 1}}}},
        "volumeMounts": {"type": "array", "description": "Where the trainer container mounts spec.volumes.",
                         "items": {"type": "object", "required": ["name", "mountPath"], "properties": {
                             "name": {"type": "string"}, "mountPath": {"type": "string"},
                             "readOnly": {"type": "boolean"}, "subPath": {"type": "string"}}}},
        "env": {"type": "array", "description": "Extra environment variables of the trainer container, e.g. "
                "AWS_ENDPOINT_URL for an S3-compatible store or credentials from a Secret. Each has a value or "
                f"a valueFrom ({', '.join(ospec.ENV_SOURCES)}); the pod contract's variables "
                f"({', '.join(ospec.CONTRACT_ENV)}) cannot be set here.",
                "items": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "minLength": 1}, "value": {"type": "string"},
                    "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
    }
    for group, cls in (("model", tcfg.ModelConfig), ("parallelism", tcfg.ParallelConfig),
                       ("training", tcfg.TrainingConfig), ("data", tcfg.DataConfig),
                       ("checkpoint", tcfg.CheckpointConfig), ("health", tcfg.HealthConfig),
                       ("logging", tcfg.LoggingConfig), ("init", tcfg.InitConfig),
                       ("trainer", ospec.TrainerConfig), ("faultTolerance", ospec.FaultToleranceConfig),
                       ("compileCache", ospec.CompileCacheConfig)):
        props[group] = schema_for(cls)
    return {"type": "object", "required": ["image", "nodes", "checkpoint"], "properties": props,
            "x-kubernetes-validations": [{"rule": r, "message": m, "fieldPath": p.removeprefix("spec")}
                                         for r, m, p in RULES]}


def status_schema() -> dict:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
        "phase": {"type": "string"}, "attempt": {"type": "integer"}, "step": {"type": "integer"},
        "tokens": {"type": "integer"}, "restartCount": {"type": "integer"}, "dataParallel": {"type": "integer"},
        "message": {"type": "string"},
        "quarantinedNodes": {"type": "array", "items": {"type": "string"}},
        "conditions": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    }}


def crd() -> dict:
    cols = [("Phase", "string", ".status.phase"), ("Step", "integer", ".status.step"),
            ("Restarts", "integer", ".status.restartCount"), ("Checkpoint", "integer", ".status.lastCheckpoint.step"),
            ("Goodput", "number", ".status.goodput.effectiveRatio"), ("DP", "integer", ".status.dataParallel"),
            ("Age", "date", ".metadata.creationTimestamp")]
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{ospec.PLURAL}.{ospec.API_GROUP}"},
        "spec": {"group": ospec.API_GROUP, "scope": "Namespaced",
                 "names": {"kind": ospec.KIND, "plural": ospec.PLURAL, "singular": "trainingrun",
                           "shortNames": ["trun"], "categories": ["all"]},
                 "versions": [{"name": ospec.API_VERSION, "served": True, "storage": True,
                               "subresources": {"status": {}},
                               "additionalPrinterColumns": [{"name": n, "type": t, "jsonPath": p} for n, t, p in cols],
                               "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                                   "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "metadata": {"type": "object"}, "spec": spec_schema(),
                                   "status": status_schema()}}}}]},
    }


def render() -> str:
    return ("# Generated by `python -m trainium_operator.crd` from trainer/config.py and\n"
            "# operator/trainium_operator/spec.py. Do not edit by hand.\n" + yaml.safe_dump(crd(), sort_keys=False))


# Where the CRD is committed: the plain manifest and the Helm chart's copy (Helm installs crds/).
COMMITTED = ("crds/trainingruns.trainium.dev.yaml", "charts/trainium-operator/crds/trainingruns.trainium.dev.yaml")


if __name__ == "__main__":
    # python -m trainium_operator.crd            print it
    # python -m trainium_operator.crd --write    update both committed copies (run from the repo root)
    if sys.argv[1:] == ["--write"]:
        from pathlib import Path
        for path in COMMITTED:
            Path(path).write_text(render())
            print(f"wrote {path}")
    else:
        sys.stdout.write(render())
