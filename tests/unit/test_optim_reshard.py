"""The optimizer's state cut for another data-parallel degree (model.optim.ShardedAdamW._cut): a
checkpoint written with ZeRO-1 at DP d resumes at DP d' (ZeRO-1 or not) with exactly the same
moments, in one process per rank here (each rank's object built as that rank would build it; the
multi-process resume: tests/trainer/test_training.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import from_dict
from trainer.model.optim import ShardedAdamW
from trainer.model.parallel import ParallelState
from trainium_api.layout import Layout

SHAPES = [(7, 5), (13,), (3, 3, 3), (1,)]  # 103 values: no degree below divides it evenly


def _ps(dp: int, dp_rank: int) -> ParallelState:
    layout = Layout(world_size=dp, tensor=1, pipeline=1, data=dp, grad_accum_steps=1, tokens_per_step=1)
    return ParallelState(backend="cpu", device=torch.device("cpu"), rank=dp_rank, world_size=dp, local_rank=dp_rank,
                         layout=layout, tp_rank=0, dp_rank=dp_rank, tp_group=None, dp_group=None,
                         sequence_parallel=False)


def _optim(dp: int, rank: int, zero1: bool) -> ShardedAdamW:
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(SHAPES)]
    return ShardedAdamW(params, from_dict({"data": {"sources": ["/c"], "tokenizer": "/t"}}).training, _ps(dp, rank),
                        zero1)


def _written(dp: int, zero1: bool) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """The slices a run at ``dp`` saves (moments: 0, 1, 2, ... over the whole flat vector)."""
    total = sum(torch.Size(s).numel() for s in SHAPES)
    whole_avg, whole_sq = torch.arange(total, dtype=torch.float32), torch.arange(total, dtype=torch.float32) ** 2
    slices = []
    for rank in range(dp if zero1 else 1):
        opt = _optim(dp, rank, zero1)
        padded_avg = torch.cat([whole_avg, torch.zeros(opt.pad)])
        padded_sq = torch.cat([whole_sq, torch.zeros(opt.pad)])
        opt.exp_avg.copy_(padded_avg[opt.start:opt.start + opt.shard_len])
        opt.exp_avg_sq.copy_(padded_sq[opt.start:opt.start + opt.shard_len])
        opt.step_count = 7
        slices.append(opt.state_dict())
    return slices, whole_avg, whole_sq


@pytest.mark.parametrize("old,new", [((2, True), (1, False)), ((4, True), (3, True)), ((3, True), (2, False)),
                                     ((1, False), (4, True)), ((2, True), (5, True))])
def test_the_moments_are_exactly_the_old_ones_at_another_degree(old, new):
    slices, whole_avg, whole_sq = _written(*old)
    dp, zero1 = new
    got_avg, got_sq = [], []
    for rank in range(dp if zero1 else 1):
        opt = _optim(dp, rank, zero1)
        opt.load_state_dict(slices)
        assert opt.step_count == 7
        got_avg.append(opt.exp_avg), got_sq.append(opt.exp_avg_sq)
    total = whole_avg.numel()
    assert torch.equal(torch.cat(got_avg)[:total], whole_avg) and torch.equal(torch.cat(got_sq)[:total], whole_sq)
    assert not torch.cat(got_avg)[total:].any()  # the padding stays zero


def test_slices_that_do_not_fit_are_refused():
    slices, _, _ = _written(2, True)
    with pytest.raises(ValueError, match="not one of 1 equal slices"):
        _optim(1, 0, False).load_state_dict(slices[1:])
    other = dict(slices[1], param_names=["x"] * 4)
    with pytest.raises(ValueError, match="other parameters"):
        _optim(1, 0, False).load_state_dict([slices[0], other])
    with pytest.raises(ValueError, match="different steps"):
        _optim(1, 0, False).load_state_dict([slices[0], dict(slices[1], step=8)])


def test_a_rank_needs_only_the_old_slices_its_range_overlaps_and_keeps_none_of_them():
    """The checkpointer reads only the overlapping slices (a rank's memory and reads stay about one
    slice, whatever the degrees); the result has its own storage, not a view of an old slice."""
    from trainer.model.optim import shard_geometry

    slices, whole_avg, _ = _written(4, True)
    numel = whole_avg.numel()
    for rank in range(3):
        opt = _optim(3, rank, True)
        start, length, _ = shard_geometry(numel, 3, rank)
        old_len = slices[0]["shard"][1]
        wanted = range(start // old_len, -(-min(start + length, numel) // old_len))
        assert len(wanted) <= 2
        opt.load_state_dict({"slices": {i: slices[i] for i in wanted}, "count": 4})
        expected = torch.cat([whole_avg, torch.zeros(opt.pad)])[opt.start:opt.start + opt.shard_len]
        assert torch.equal(opt.exp_avg, expected)
    lonely = _optim(3, 1, True)
    with pytest.raises(ValueError, match="was not read"):
        lonely.load_state_dict({"slices": {0: slices[0]}, "count": 4})
    cut = _optim(1, 0, False)._cut(dict(enumerate(slices)), 4)
    assert all(cut["exp_avg"].untyped_storage().data_ptr() != s["exp_avg"].untyped_storage().data_ptr()
               for s in slices)


def test_copies_of_the_same_values_round_alike_under_bf16_sr():
    """bf16-sr's rounding generator: one stream for the data-parallel replicas without ZeRO-1
    (each rounds the whole buffer: different noise made them drift apart) and for the tensor
    ranks (their replicated norms and key/value heads sit at the same offsets); with ZeRO-1 one
    per slice, each slice being one rank's alone."""
    import dataclasses

    def state(dp: int, dp_rank: int, tp_rank: int, zero1: bool) -> torch.Tensor:
        params = [(f"p{i}", torch.nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(SHAPES)]
        training = dataclasses.replace(from_dict({"data": {"sources": ["/c"], "tokenizer": "/t"}}).training,
                                       precision="bf16-sr")
        ps = dataclasses.replace(_ps(dp, dp_rank), tp_rank=tp_rank, rank=dp_rank * 2 + tp_rank)
        return ShardedAdamW(params, training, ps, zero1).gen.get_state()

    assert torch.equal(state(2, 0, 0, False), state(2, 1, 0, False))  # data-parallel replicas
    assert torch.equal(state(2, 0, 0, False), state(2, 0, 1, False))  # tensor ranks
    assert not torch.equal(state(2, 0, 0, True), state(2, 1, 0, True))  # ZeRO-1: a stream per slice
    assert torch.equal(state(2, 1, 0, True), state(2, 1, 1, True))


def test_replicas_that_lose_zero1_on_load_take_one_rounding_stream():
    """A ZeRO-1 checkpoint (a stream per slice) resumed without ZeRO-1: every data-parallel
    replica rounds the whole buffer, so each takes the same (the lowest slice's) stream, not the
    slice of its own index (found by review: the replicas drifted apart again)."""
    slices, _, _ = _written(2, True)
    assert not torch.equal(slices[0]["generator"], slices[1]["generator"])
    loaded = []
    for rank in range(2):
        opt = _optim(2, rank, False)
        opt.load_state_dict(slices)
        loaded.append(opt.gen.get_state())
    assert torch.equal(loaded[0], loaded[1]) and torch.equal(loaded[0], slices[0]["generator"])
