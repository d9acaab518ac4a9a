"""The environment a trainer pod's processes read (docs/architecture.md 3.2).

The names the operator sets are the API's (trainium_api); this module adds the ones the
trainer sets for its own children.
"""

from __future__ import annotations

# Neuron pre-compilation: `--neuron-precompile-steps N` first runs the same command under
# `neuron_parallel_compile`, which executes no graph but extracts every graph of N steps and
# compiles them in parallel into the node-local cache; then the real run starts. The trainer
# sees this variable in that pass and writes nothing (no checkpoint, progress or losses).
# trainer.pod.launch sets it; PRECOMPILE_FLAG is in trainium_api.launch (the operator writes it
# into the pod command).
PRECOMPILE_ENV = "TRAINER_PRECOMPILE_STEPS"
