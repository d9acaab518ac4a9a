"""Throughput accounting (MFU from a written formula) and the Prometheus endpoint."""

from __future__ import annotations

from ..config import ModelConfig

# Dense BF16 peak FLOP/s per device: a GPU, or one physical NeuronCore (a rank drives
# NEURON_LOGICAL_NC_CONFIG of them: 1 on trn1, 2 by default on trn2)
PEAK_FLOPS = {
    "neuron-trn1": 95e12,   # trn1.32xlarge: 3,040 TFLOPS over 32 NeuronCore-v2 (docs/neuron.md)
    "neuron-trn2": 83.4e12,  # trn2: 667 TFLOPS dense BF16 per chip of 8 NeuronCore-v3 (docs/neuron.md)
    "cuda-H100": 989e12,
    "cuda-H200": 989e12,
    "cuda-A100": 312e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12 L H Q T (PaLM appendix B; nanoGPT estimate_mfu): N parameters without the
    input embedding, L layers, H heads, Q head dimension, T sequence length."""
    # the input embedding's lookup is no matmul; a tied head is one (num_params counts the matrix once)
    n = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)
    return 6 * n + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim() * seq_len


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, world_size: int,
        peak_per_device: float | None) -> float | None:
    if not peak_per_device:
        return None
    return tokens_per_second * flops_per_token(cfg, seq_len) / (world_size * peak_per_device)


class TrainerMetrics:
    """Prometheus series of one trainer process (served by local rank 0 of each pod)."""

    def __init__(self, port: int, labels: dict[str, str]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        names = sorted(labels)
        self._labels = [labels[n] for n in names]

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=self.registry).labels(*self._labels)

        def counter(name, doc):
            return Counter(name, doc, names, registry=self.registry).labels(*self._labels)

        self.step = gauge("trainer_step", "Optimizer steps finished")
        self.loss = gauge("trainer_loss", "Training loss of the last step")
        self.lr = gauge("trainer_learning_rate", "Learning rate of the last step")
        self.grad_norm = gauge("trainer_grad_norm", "Global gradient norm before clipping")
        self.param_norm = gauge("trainer_param_norm", "Global parameter norm (at log steps)")
        self.tokens_per_second = gauge("trainer_tokens_per_second", "Tokens per second, whole job")
        self.step_seconds = gauge("trainer_step_seconds", "Wall time of the last step")
        self.mfu = gauge("trainer_mfu_ratio", "Model FLOPs utilisation (0-1); absent when the peak is unknown")
        self.tokens = counter("trainer_tokens", "Tokens trained on")
        self.ckpt_stall = gauge("trainer_checkpoint_stall_seconds", "Loop time blocked by the last save")
        self.ckpt_step = gauge("trainer_checkpoint_last_step", "Step of the newest complete checkpoint")
        self.ckpt_durable = gauge("trainer_checkpoint_durable_seconds", "From the newest complete checkpoint's save "
                                  "call until it was complete in the store (rank 0's pod only: it writes the marker)")
        self.ckpt_failures = counter("trainer_checkpoint_failures", "Checkpoint saves that did not complete")
        self.restore_seconds = gauge("trainer_restore_seconds",
                                     "Time this attempt took to read and load the checkpoint it resumed from")
        self._restore_source = Gauge("trainer_restore_source",
                                     "1 for where this attempt's restore read its state from (memory, peer or "
                                     "store: the slowest rank's), 0 for the others", names + ["source"],
                                     registry=self.registry)
        self.spikes = counter("trainer_grad_spikes", "Steps whose gradient norm spiked")
        self.skipped = counter("trainer_skipped_steps", "Updates skipped for NaN/Inf")
        self.eval_loss = gauge("trainer_eval_loss", "Mean token loss on data.heldOut at the last evaluation")
        self.eval_perplexity = gauge("trainer_eval_perplexity", "Perplexity on data.heldOut at the last evaluation")
        self.server = None
        if port:
            self.server, _ = start_http_server(port, registry=self.registry)

    def restored_from(self, source: str | None) -> None:
        from trainium_api.checkpoints import RESTORE_SOURCES
        for s in RESTORE_SOURCES:
            self._restore_source.labels(*self._labels, s).set(1 if s == source else 0)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
