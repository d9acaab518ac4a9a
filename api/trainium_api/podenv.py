"""The pod contract's environment (docs/architecture.md 3.2): every variable the operator sets in
a trainer pod, named once. The operator's pod builder (trainium_operator.plan) writes them; the
trainer reads them once, at each process's entry, into ``trainer.contract.podenv.PodEnv``.

Names that belong to a flag or a protocol are defined beside it (trainium_api.launch,
trainium_api.agent) and listed here.
"""

from __future__ import annotations

from .agent import AWAIT_START_ENV, BUSY_DIR_ENV, WARM_ENV
from .launch import (PREFLIGHT_HEARTBEATS_ENV, PREFLIGHT_PASSED_FILE_ENV, PREFLIGHT_SECONDS_ENV,
                     PREFLIGHT_SECONDS_FILE_ENV, TERMINATION_LOG_ENV)

# The rendezvous (the agent rewrites MASTER_ADDR and NODE_RANK for its workers on each order).
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
NNODES = "NNODES"
NODE_RANK = "NODE_RANK"
NPROC_PER_NODE = "NPROC_PER_NODE"
# The run and the attempt: with ATTEMPT, TRAINING_RUN_CREATED (epoch seconds) orders the gangs
# that write one checkpoint store, for fencing.
TRAINING_RUN = "TRAINING_RUN"
TRAINING_RUN_CREATED = "TRAINING_RUN_CREATED"
ATTEMPT = "ATTEMPT"
CHECKPOINT_URI = "CHECKPOINT_URI"
RESUME = "RESUME"  # always "auto"
NEURON_COMPILE_CACHE_URL = "NEURON_COMPILE_CACHE_URL"
# The pod itself (downward API).
POD_NAME = "POD_NAME"
POD_NAMESPACE = "POD_NAMESPACE"
NODE_NAME = "NODE_NAME"
# With the pre-flight check on Neuron: the Neuron devices the instance type has.
PREFLIGHT_DEVICES_ENV = "TRAINER_PREFLIGHT_DEVICES"
# On Trainium: the compiler's flags (compileCache.extraFlags) and, on Trainium2, the logical
# NeuronCore config.
NEURON_CC_FLAGS = "NEURON_CC_FLAGS"
NEURON_LOGICAL_NC_CONFIG = "NEURON_LOGICAL_NC_CONFIG"
# On Trainium, with the runtime's other variables (trainium_operator.plan.NEURON_ENV, which
# spec.env may override): the NeuronCores a pod's ranks use.
NEURON_RT_NUM_CORES = "NEURON_RT_NUM_CORES"

CONTRACT = (MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE, TRAINING_RUN, TRAINING_RUN_CREATED, ATTEMPT,
            CHECKPOINT_URI, RESUME, NEURON_COMPILE_CACHE_URL, POD_NAME, POD_NAMESPACE,
            TERMINATION_LOG_ENV, NODE_NAME, PREFLIGHT_DEVICES_ENV, PREFLIGHT_PASSED_FILE_ENV,
            NEURON_LOGICAL_NC_CONFIG, NEURON_CC_FLAGS)
"""Every variable the operator sets (spec.env may not override them)."""
CONDITIONAL = (PREFLIGHT_DEVICES_ENV, PREFLIGHT_PASSED_FILE_ENV, NEURON_LOGICAL_NC_CONFIG, NEURON_CC_FLAGS)
"""The contract's variables set only sometimes (trainium_api.spec.CONDITIONAL_ENV)."""
RETIRED = ("TRAINER_PREFLIGHT_PASSED",)
"""Variables the operator no longer sets, still refused in spec.env: a trainer image of an earlier
release reads them (the list of nodes that passed the pre-flight check: one set by hand would
skip the check)."""

__all__ = ["ATTEMPT", "AWAIT_START_ENV", "BUSY_DIR_ENV", "CHECKPOINT_URI", "CONDITIONAL", "CONTRACT", "MASTER_ADDR",
           "MASTER_PORT", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_NUM_CORES",
           "NNODES", "NODE_NAME", "NODE_RANK", "NPROC_PER_NODE", "POD_NAME", "POD_NAMESPACE", "PREFLIGHT_DEVICES_ENV",
           "PREFLIGHT_HEARTBEATS_ENV", "RETIRED", "PREFLIGHT_PASSED_FILE_ENV", "PREFLIGHT_SECONDS_ENV", "PREFLIGHT_SECONDS_FILE_ENV",
           "RESUME", "TERMINATION_LOG_ENV", "TRAINING_RUN", "TRAINING_RUN_CREATED", "WARM_ENV"]
