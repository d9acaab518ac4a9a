"""STAND-IN: the collectives config of ring attention.

NxD's ``initialize_model_parallel`` builds one on every call (parallel_state.py) and keeps
``rank_src_tgt_pairs[rank]``, which only its NKI ring-attention kernel reads (context
parallelism, which the NxD tier does not run). The real config computes the ring's
send/receive pairs for the NeuronLink topology; this one gives each rank the plain ring of its
context-parallel group as [sender, receiver] pairs, so the groups can be built. Nothing in the
tier reads them."""


class CollectivesConfig:
    def __init__(self, replica_groups):
        self.rank_src_tgt_pairs = {}
        for group in replica_groups:
            ring = [[group[i], group[(i + 1) % len(group)]] for i in range(len(group))]
            for rank in group:
                self.rank_src_tgt_pairs[rank] = ring
