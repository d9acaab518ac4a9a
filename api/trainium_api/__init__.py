"""The TrainingRun API: one typed source for the spec and the status.

  spec     every spec field: type, constraint, default, documentation (dataclasses)
  status   every status field the operator writes (dataclasses)
  layout   the parallel layout a spec implies, checked before anything is scheduled
  fields   how a field is declared (Annotated markers) and the walker that reads declarations
  load     dicts <-> dataclasses, refusing bad input with the field named
  presets  the model preset expanded before building, the cross-field finish after
  schema   the CRD's structural OpenAPI schema, derived from the declarations

The pod contract the operator shares with the trainer (docs/architecture.md 3.2, 3.3):

  exitcodes    what a pod's exit code means (fatal, retryable, terminated)
  progress     the progress annotation: its fields, how it is written and read back (checked)
  checkpoints  the checkpoint store: tag names, markers, layouts, the newest complete tag
  launch       flags of the pod command that trainer.pod.launch takes before torchrun

Imports no torch and no Kubernetes client: the trainer, the operator and the tests share it.
"""

API_GROUP, API_VERSION, KIND, PLURAL = "trainium.dev", "v1alpha1", "TrainingRun", "trainingruns"
