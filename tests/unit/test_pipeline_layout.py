"""Pipeline stages and replicated key/value heads, in one process: rank order, stage
contents, stage-by-stage forward, and the Hugging Face shard layout."""

from __future__ import annotations

import pytest
import torch

from trainer.model import hf
from trainer.config import PRESETS, ConfigError, ModelConfig, ParallelConfig, TrainingConfig, derive_layout
from trainer.model.transformer import Transformer, stage_layers
from trainer.model.parallel import RankGrid, TPContext, replicated_row_ranges, shard_rows

TINY = ModelConfig()  # 4 layers, 4 heads, 2 key/value heads


def preset(name: str) -> ModelConfig:
    return ModelConfig(preset=name, **PRESETS[name])


def test_rank_grid_is_nxd_order():
    """NxD parallel_state.initialize_model_parallel's own example: 32 ranks, TP 8, PP 4."""
    grid = RankGrid(pp=4, dp=1, tp=8)
    assert grid.groups("pp")[:2] == [[0, 8, 16, 24], [1, 9, 17, 25]]
    assert grid.groups("tp")[1] == list(range(8, 16))
    assert grid.groups("dp") == [[r] for r in range(32)]
    grid = RankGrid(pp=2, dp=2, tp=2)
    assert [grid.coords(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert all(grid.rank(*grid.coords(r)) == r for r in range(8))


def test_stages_hold_the_single_process_weights_under_the_same_names():
    full = Transformer(TINY, seed=3)
    stages = [Transformer(TINY, seed=3, stage=(i, 2)) for i in range(2)]
    whole = full.state_dict()
    names = [set(s.state_dict()) for s in stages]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(whole)
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
    assert "model.layers.2.mlp.down_proj.weight" in names[1]  # global layer index kept
    for stage in stages:
        for k, v in stage.state_dict().items():
            assert torch.equal(v, whole[k]), k
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chained = stages[1].stage_forward(stages[0].stage_forward(ids))
        assert torch.allclose(chained, full.logits(ids), atol=1e-6)
    assert list(stage_layers(44, (1, 4))) == list(range(11, 22))


def test_replicated_kv_heads_shard_like_gqa():
    """TP 4 over 2 key/value heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1 (query heads
    0-1 use key/value head 0 in grouped-query attention); the replicated rows are recorded."""
    hd, h = 8, 32
    splits, reps = [4 * hd, 2 * hd, 2 * hd], [1, 2, 2]
    full = torch.arange(sum(splits) * h, dtype=torch.float32).view(sum(splits), h)
    q, k, v = full.split(splits)
    for r in range(4):
        got = shard_rows(full, TPContext(4, r), splits, reps)
        assert torch.equal(got, torch.cat([q[r * hd:(r + 1) * hd], k[(r // 2) * hd:(r // 2 + 1) * hd],
                                           v[(r // 2) * hd:(r // 2 + 1) * hd]]))
    assert replicated_row_ranges(splits, reps, 4, h) == [(hd * h, 2 * hd * h), (2 * hd * h, 3 * hd * h)]
    assert TINY.kv_replicas(4) == 2 and TINY.kv_replicas(2) == 1


def test_hf_shards_round_trip_with_replicated_kv_heads():
    cfg = TINY
    full = Transformer(cfg, seed=1)
    hf_tensors = hf.merge_to_hf([full.state_dict()], cfg)
    shards = [hf.shard_of(hf_tensors, cfg, 4, r) for r in range(4)]
    for r in range(4):
        model = Transformer(cfg, TPContext(4, r), seed=1)
        for k, v in model.state_dict().items():
            assert torch.equal(shards[r][k], v), (r, k)
    back = hf.merge_to_hf(shards, cfg)
    assert all(torch.equal(back[k], hf_tensors[k]) for k in hf_tensors)


def test_published_pipeline_layouts_derive():
    """The presets' published layouts: NeoX 20B at TP 8 x PP 4 on 4 nodes, Llama 2 70B at
    TP 32 x PP 8 on 32 nodes (8 key/value heads, each on 4 ranks)."""
    neox = derive_layout(4 * 32, preset("neox-20b"), ParallelConfig(tensor=8, pipeline=4),
                         TrainingConfig(seq_len=2048, global_batch_size=1024, micro_batch_size=1), "neuron", 32)
    assert (neox.data, neox.grad_accum_steps) == (4, 256)
    llama = preset("llama2-70b")
    lay = derive_layout(32 * 32, llama, ParallelConfig(tensor=32, pipeline=8, zero1=True),
                        TrainingConfig(seq_len=4096, global_batch_size=1024, micro_batch_size=1), "neuron", 32)
    assert (lay.data, lay.grad_accum_steps, llama.kv_replicas(32)) == (4, 256, 4)
    with pytest.raises(ConfigError) as err:
        derive_layout(3, TINY, ParallelConfig(tensor=3), TrainingConfig(global_batch_size=12, micro_batch_size=4))
    assert err.value.field == "parallelism.tensor"
