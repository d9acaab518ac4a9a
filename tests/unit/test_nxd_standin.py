"""Our NxD layer factory (trainer.neuron.NxDLayers) run against a STAND-IN of NxD.

The stand-in (tests/standins/neuronx_distributed, see its README) copies the signatures of NxD
2.29's ColumnParallelLinear, RowParallelLinear, ParallelEmbedding, the two mappings and
parallel_cross_entropy, with tensor-parallel degree 1 behaviour. What this proves: every
keyword argument the factory passes exists in those signatures, the factory's own code runs,
and the model it builds has the PyTorch backend's parameter names, shapes and values and gives
the same loss. What it does not prove: anything about NxD's numerics, collectives, tensor
parallelism above 1, sequence parallel, or Trainium.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_xla", reason="NxDLayers uses torch-xla's activation checkpointing")
STANDINS = Path(__file__).resolve().parents[1] / "standins"


@pytest.fixture
def standin_nxd(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDINS))
    yield
    for name in [m for m in sys.modules if m.startswith("neuronx_distributed")]:
        del sys.modules[name]


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_nxd_layer_factory_builds_our_model_with_a_standin_of_nxd(standin_nxd, family):
    from trainer.config import ModelConfig
    from trainer.model import Transformer
    from trainer.neuron import NxDLayers
    from trainer.parallel import TPContext

    cfg = ModelConfig(family=family, num_kv_heads=2 if family == "llama" else 4, rotary_pct=1.0 if family == "llama"
                      else 0.25)
    ours = Transformer(cfg, TPContext(), seed=3, max_seq_len=32)
    nxd = Transformer(cfg, NxDLayers(1, 0, None, False), seed=3, max_seq_len=32)
    assert type(nxd.model.layers[0].self_attn.qkv_proj).__module__ == "neuronx_distributed.parallel_layers.layers"
    a, b = ours.state_dict(), nxd.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name
    if family == "neox":  # the replicated row-parallel bias is marked for the optimizer as ours is
        assert nxd.model.layers[0].self_attn.o_proj.bias.tp_replicated
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    targets[0, :3] = -100  # ignored targets are masked by the factory (NxD's loss has no ignore_index)
    with torch.no_grad():
        assert torch.allclose(nxd(ids, targets), ours(ids, targets), rtol=1e-6, atol=1e-6)
