import socket
import urllib.request

from trainer.config import from_dict
from trainer.model.metrics import TrainerMetrics, flops_per_token, mfu


def test_mfu_formula_llama2_7b():
    m = from_dict({"model": {"preset": "llama2-7b"}, "data": {"sources": ["x"], "tokenizer": "t"}}).model
    n = m.num_params() - 32000 * 4096
    assert flops_per_token(m, 4096) == 6 * n + 12 * 32 * 32 * 128 * 4096
    # docs/neuron.md anchor: ~24k tokens/s per trn1.32xlarge node (32 cores) is about 37% MFU.
    util = mfu(24_000 * 16, m, 4096, 16 * 32, 95e12)
    assert 0.33 < util < 0.41
    assert mfu(1.0, m, 4096, 1, None) is None


def test_metrics_endpoint_serves_prometheus_text():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = TrainerMetrics(port, {"run": "r1", "node_rank": "0"})
    try:
        metrics.step.set(42)
        metrics.ckpt_failures.inc()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'trainer_step{node_rank="0",run="r1"} 42.0' in body
        assert 'trainer_checkpoint_failures_total{node_rank="0",run="r1"} 1.0' in body
    finally:
        metrics.close()
