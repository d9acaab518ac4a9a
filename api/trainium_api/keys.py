"""Every label, annotation, taint and finalizer key the operator and the trainer share.

One module, so the code that reads a pod (the operator's observer, the trainer's watch) names a
key without importing the code that builds the pod. Who writes each key and what its value
means is in docs/architecture.md 3.2, the pod contract.
"""

PREFIX = "trainium.dev/"

# labels on every child pod (trainium_operator.plan)
RUN = PREFIX + "run"
ATTEMPT = PREFIX + "attempt"
INDEX = PREFIX + "index"
SPARE = PREFIX + "spare"  # "true" on a standby pod until it takes an index
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"  # Karpenter's (GA): no consolidation or drift of the pod's node
MANAGED_BY = {"app.kubernetes.io/managed-by": "trainium-operator"}
PART_OF = {"app.kubernetes.io/part-of": "trainium-operator"}

# annotations a pod's own processes write (the trainer's role allows these and no others)
PROGRESS = PREFIX + "progress"  # trainium_api.progress: the trainer's step, loss, checkpoint, store
PREFLIGHT = PREFIX + "preflight"  # trainium_api.preflight: the launcher's pre-flight state
AGENT_REPORT = PREFIX + "agent"  # trainium_api.agent: the pod agent's attempt and state
TRAINER_WRITES = (PROGRESS, PREFLIGHT, AGENT_REPORT)

# annotations the operator writes
ORDER = PREFIX + "order"  # trainium_api.agent: the operator's order to a pod's agent
# a label on the run's gang order ConfigMap (trainium_api.agent.GangOrder): the operator's index of
# them, and the admission policy that keeps every trainer from writing one, select by it
GANG_ORDER = PREFIX + "gang-order"
PREFLIGHT_LIST = PREFIX + "preflight-list"  # on a run's ConfigMap of nodes that passed the pre-flight check
INSTANCE_TYPE = PREFIX + "instance-type"  # the instance type a pod was built for
POLICY_DIGEST = PREFIX + "policy-digest"  # of a trainer policy's spec: replace only our own

# on nodes and runs
QUARANTINE_TAINT = PREFIX + "quarantined"  # NoSchedule on a node the operator quarantined

# node labels of EKS's network topology (the AWS cloud controller manager, from EC2's
# DescribeInstanceTopology): layer 1 the farthest network node from the instance, 3 the nearest
NETWORK_LAYER = "topology.k8s.aws/network-node-layer-"
NETWORK_LAYERS = (3, 2, 1)  # nearest first
# the Neuron device plugin's label of a trn2u node's UltraServer (of 4 nodes; -2: of 2)
# (aws-neuron-sdk containers/how-to/how-to-ultraserver.rst)
ULTRASERVER = "neuron.amazonaws.com/ultraserver-server-id-4"
ULTRASERVER_NODES = 4

# taints others put on a node that is about to be terminated: a run moves off at once, at a save
KARPENTER_DISRUPTED = "karpenter.sh/disrupted"  # Karpenter v1's termination controller (no value, NoSchedule)
TERMINATION_NOTICE_TAINTS = frozenset({
    KARPENTER_DISRUPTED,  # consolidation, drift, expiry, repair, a Spot interruption (its 2-minute notice)
    "karpenter.sh/disruption",  # Karpenter before v1 (value "disrupting")
    # aws-node-termination-handler (pkg/node/node.go), when run with taintNode: a Spot interruption,
    # an Auto Scaling group's termination, an EC2 scheduled maintenance. Its rebalance
    # recommendation is only a hint that an interruption may come: not acted on
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "aws-node-termination-handler/scheduled-maintenance",
})
FINALIZER = PREFIX + "operator"  # on a TrainingRun until the operator has let go of it
