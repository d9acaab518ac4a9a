"""The pod command's entry points and own flags: the operator builds the command line
(``python -m trainer.launch [FLAGS] [torchrun options] ...``, trainium_operator.plan) and the
launcher (trainer.pod.launch) takes these flags out before torchrun parses the rest. Defined here
so both sides read one spelling without the operator importing the trainer.
"""

import hashlib

# The modules the pod command runs. They are the pod contract: a trainer image built before or
# after an operator upgrade must answer to the names the operator writes, so these stay the
# same when the trainer's code moves (trainer/launch.py and trainer/watch.py are only these
# entry points; the code is trainer.pod.launch and trainer.pod.watch).
LAUNCH_MODULE = "trainer.launch"
WATCH_MODULE = "trainer.watch"

# `--neuron-precompile-steps N` (spec.compileCache.precompileSteps): trainer.pod.launch first runs the
# same command under neuron_parallel_compile for N steps, then the real run.
PRECOMPILE_FLAG = "--neuron-precompile-steps"

# Where trainer.pod.launch writes what the Neuron runtime said when a worker failed: the operator
# sets this variable to the container's terminationMessagePath (trainium_api.runtimefaults).
TERMINATION_LOG_ENV = "TRAINER_TERMINATION_LOG"

# `--preflight FACTOR,TIMEOUT,BACKEND` (spec.faultTolerance.preflight, spec.backend): trainer.pod.launch
# first runs the pre-flight check (trainer.pod.preflight) with the same torchrun arguments, on the
# run's backend, then the real run.
PREFLIGHT_FLAG = "--preflight"
# The seconds the check took, for the real run's progress reports (goodput's preflight phase).
PREFLIGHT_SECONDS_ENV = "TRAINER_PREFLIGHT_SECONDS"
# ...and, for a command trainer, into this file (trainer.pod.watch, the launcher's parent, names it).
PREFLIGHT_SECONDS_FILE_ENV = "TRAINER_PREFLIGHT_SECONDS_FILE"
# The directory where the check's ranks keep their heartbeat files, one per PID, for their
# launcher (trainer.pod.liveness; tests read it to freeze a rank mid-check).
PREFLIGHT_HEARTBEATS_ENV = "TRAINER_PREFLIGHT_HEARTBEATS"

# `--agent` (in-place restarts, spec.faultTolerance.inPlaceRestarts): trainer.pod.launch becomes the
# pod's agent (trainer.pod.agent), which runs the rest of the command as its child and starts new
# workers on the operator's order (trainium_api.agent) instead of ending the pod.
AGENT_FLAG = "--agent"
# Nodes that passed the run's pre-flight check recently (the operator's; the check is skipped
# when every pod is on one), as a file: a list of thousands of node names in the environment
# exceeds what the kernel lets a process start with (E2BIG, about 3,000 names). The operator
# writes the list once, in a ConfigMap of the run shared by the pods given that list
# (trainium_operator.plan.preflight_map, one node_token a line), mounted at PREFLIGHT_PASSED_DIR,
# and this variable names the file. An in-place restart after a hang starts its workers without it.
PREFLIGHT_PASSED_FILE_ENV = "TRAINER_PREFLIGHT_PASSED_FILE"
PREFLIGHT_PASSED_VOLUME = "trainium-preflight"
PREFLIGHT_PASSED_DIR = "/etc/trainium-preflight"
PREFLIGHT_PASSED_FILE = PREFLIGHT_PASSED_DIR + "/passed"
NODE_TOKEN_CHARS = 12


def node_token(node: str) -> str:
    """A node name as the list of passed nodes holds it: the first 12 hex digits of its SHA-256
    (13 bytes a node with its newline, against about 45 for an EKS name: 4,096 nodes take 53 KB
    of the pod's 256 KB of annotations; two names of a 16,384-node cluster share one with odds
    of about 1 in 10^6)."""
    return hashlib.sha256(node.encode()).hexdigest()[:NODE_TOKEN_CHARS]
