"""The pod command's own flags: the operator builds the command line
(``python -m trainer.launch [FLAGS] [torchrun options] ...``, trainium_operator.plan) and
trainer.launch takes these flags out before torchrun parses the rest. Defined here so both
sides read one spelling without the operator importing the trainer.
"""

# `--neuron-precompile-steps N` (spec.compileCache.precompileSteps): trainer.launch first runs the
# same command under neuron_parallel_compile for N steps, then the real run.
PRECOMPILE_FLAG = "--neuron-precompile-steps"
