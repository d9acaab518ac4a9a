import math

import torch

from trainer.config import TrainingConfig
from trainer.loop.health import GradNormMonitor
from trainer.model.optim import lr_at, stochastic_round_to_bf16


def test_schedule_warmup_then_cosine_to_floor():
    c = TrainingConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110)
    assert math.isclose(lr_at(0, c), 1e-4) and math.isclose(lr_at(9, c), 1e-3)
    assert math.isclose(lr_at(60, c), (1e-3 + 1e-4) / 2)
    assert math.isclose(lr_at(110, c), 1e-4) and math.isclose(lr_at(500, c), 1e-4)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 120))


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # between two bf16 neighbours (spacing 2**-7)
    r = stochastic_round_to_bf16(x, gen).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(r.mean().item() - x[0].item()) < 1e-4  # plain rounding would give exactly 1.0
    exact = torch.tensor([1.0, -2.5, 0.0])
    assert (stochastic_round_to_bf16(exact, gen).float() == exact).all()


def test_spike_detection_counts_duration():
    m = GradNormMonitor(window=20, factor=3.0)
    spikes = [m.update(s, 1.0 + 0.01 * (s % 3)) for s in range(1, 26)]
    assert not any(spikes)
    assert m.update(26, 10.0) and m.update(27, 12.0) and not m.update(28, 1.0)
    assert len(m.events) == 1 and m.events[0].start_step == 26 and m.events[0].steps == 2 and m.events[0].peak == 12.0
    restored = GradNormMonitor()
    restored.load_state(m.state())
    assert restored.state() == m.state()
    assert not m.update(29, float("nan"))


def test_fused_update_matches_the_explicit_formula():
    """The fused kernel path (fp32/mixed) and the written-out path (bf16-sr) are one update."""
    from trainer.config import derive_layout
    from trainer.model.optim import ShardedAdamW
    from trainer.model.parallel import init_parallel

    cfg = TrainingConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    from trainer.config import ModelConfig, ParallelConfig
    ps = init_parallel("cpu", lambda ws: derive_layout(ws, ModelConfig(), ParallelConfig(), cfg), False)
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    opt = ShardedAdamW([("w", w), ("b", b)], cfg, ps, zero1=False)
    ref_values, ref_m, ref_v = opt.param_buf.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()
    for step in range(1, 4):
        g = torch.randn(opt.total)
        opt.grad_buf.copy_(g)
        grads, norm = opt.sync_and_norm()
        opt.step(grads, norm, 1e-2)
        # the explicit path on copies of the previous state
        twin = ShardedAdamW([("w", torch.nn.Parameter(torch.zeros(8, 4))), ("b", torch.nn.Parameter(torch.zeros(4)))],
                            cfg, ps, zero1=False)
        twin.exp_avg.copy_(ref_m), twin.exp_avg_sq.copy_(ref_v)
        twin.step_count = step
        ref_values = twin._adamw_explicit(ref_values.clone(), g.clone(), 1e-2)
        ref_m, ref_v = twin.exp_avg.clone(), twin.exp_avg_sq.clone()
        assert torch.allclose(opt.param_buf, ref_values, rtol=1e-5, atol=1e-6)
    assert torch.equal(w.detach().reshape(-1), opt.param_buf[:32])  # parameters are views of the buffer
