"""Trainer step throughput against Hugging Face transformers' LlamaForCausalLM, same device.

    python bench/throughput.py [--steps 6] [--device cpu|cuda|xla|neuron] [--sizes tiny,100m]

``xla`` and ``neuron`` run both sides on torch-xla's device (one NeuronCore with ``neuron``;
the CPU with ``xla`` and PJRT_DEVICE=CPU): ours through the backend's layer factory and the
device-side optimizer step the Neuron backend trains with, each step one graph, timed to
completion. The figure to compare a Trainium node with is NxD's published Llama 2 7B
throughput (docs/neuron.md): about 24,000 tokens/s per trn1.32xlarge node (32 NeuronCores, TP 8,
sequence 4096), printed under the table; a one-core run of these sizes is not that figure.

Both sides train the same shapes on the same random tokens: forward, backward, AdamW with
gradient clipping. Ours is trainer.model.transformer.Transformer + trainer.model.optim.ShardedAdamW (the code the
trainer runs, single process); the peer is LlamaForCausalLM (sdpa attention) + torch.optim.AdamW
+ clip_grad_norm_. Runs alternate A/B per round so machine noise hits both alike; the table
gives median step time, tokens/s and the ratio (ours / HF tokens per second; > 1 means faster).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import median, run_config, single_process, table

SIZES = {
    # name: (model overrides, seqLen, micro batch)
    "tiny": (dict(preset="tiny"), 128, 8),
    "100m": (dict(preset="tiny", hiddenSize=768, intermediateSize=2048, numLayers=12, numHeads=12,
                  numKvHeads=12, vocabSize=32000), 256, 4),
    "1b": (dict(preset="tiny", hiddenSize=2048, intermediateSize=5632, numLayers=16, numHeads=32,
                numKvHeads=8, vocabSize=32000), 2048, 4),
}


LAZY = ("xla", "neuron")
# docs/neuron.md, "Throughput anchors": Llama 2 7B, 16 x trn1.32xlarge, TP 8 DP 64, seq 4096, GBS 1024.
NXD_LLAMA2_7B_TOKENS_PER_NODE = 24_000


def ours(cfg, device, dtype):
    from trainer.model.transformer import Transformer
    from trainer.model.optim import ShardedAdamW

    ps = single_process(cfg, device if device in LAZY else "cpu")
    if getattr(ps.impl, "native", False):  # TorchNeuron: an eager device, not torch-xla's
        raise SystemExit("bench.throughput --device neuron measures the torch-xla path; this machine's "
                         "PyTorch reports TorchNeuron's native device, which this benchmark does not cover yet")
    if device not in LAZY:
        ps.device = torch.device(device)
    model = Transformer(cfg.model, ps.impl.layers(ps), seed=0, max_seq_len=cfg.training.seq_len).to(device=ps.device,
                                                                                               dtype=dtype)
    opt = ShardedAdamW(list(model.named_parameters()), cfg.training, ps, zero1=False)

    if device in LAZY:
        import torch_xla
        lr = torch.tensor(1e-4, device=ps.device)

        def lazy_step(ids):
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            grads, sq = opt.sync_and_norm_sq()
            opt.step_on_device(grads, sq, loss.detach(), lr)
            opt.zero_grad()
            torch_xla.sync()
            return loss.detach()
        return lazy_step, sum(p.numel() for p in model.parameters())

    def step(ids):
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads, norm = opt.sync_and_norm()
        opt.step(grads, norm, 1e-4)
        opt.zero_grad()
        return loss.item()
    return step, sum(p.numel() for p in model.parameters())


def huggingface(cfg, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                     num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_kv_heads, max_position_embeddings=cfg.training.seq_len,
                     rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=False,
                     attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).to(device=device_of(device), dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    if device in LAZY:
        import torch_xla

        def lazy_step(ids):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()
            return loss.detach()
        return lazy_step, sum(p.numel() for p in model.parameters())

    def step(ids):
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, sum(p.numel() for p in model.parameters())


def device_of(kind: str) -> torch.device:
    if kind in LAZY:
        import torch_xla
        return torch_xla.device()
    return torch.device(kind)


def wait(kind: str, result=None) -> None:
    """Until the device finished the step: on XLA, reading the step's loss on the host is the
    one wait that cannot return early (wait_device_ops() returned before CPU executions ended)."""
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind in LAZY and result is not None:
        result.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="tiny,100m")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    for name in args.sizes.split(","):
        model_over, seq, batch = SIZES[name]
        cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch, "microBatchSize": batch})
        sides = {"ours": ours(cfg, args.device, dtype), "hf": huggingface(cfg, args.device, dtype)}
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=gen).to(device_of(args.device))
        times = {k: [] for k in sides}
        for _ in range(2):  # warm-up
            for step, _ in sides.values():
                step(ids)
        for i in range(args.steps):
            for key, (step, _) in sides.items():
                wait(args.device)
                t0 = time.perf_counter()
                wait(args.device, step(ids))
                times[key].append(time.perf_counter() - t0)
            print(f"[{name}] round {i + 1}/{args.steps}: ours {times['ours'][-1]:.3f}s hf {times['hf'][-1]:.3f}s", flush=True)
        tokens = batch * seq
        t_ours, t_hf = median(times["ours"]), median(times["hf"])
        mfu = ""
        if args.device == "cuda":
            from trainer.model.backends import pick
            from trainer.model.metrics import flops_per_token
            peak = pick("cuda").peak_flops()
            mfu = f"{tokens / t_ours * flops_per_token(cfg.model, seq) / peak:.1%}" if peak else ""
        rows.append([name, f"{sides['ours'][1] / 1e6:.1f}M", f"{batch}x{seq}", f"{t_ours:.3f}", f"{t_hf:.3f}",
                     f"{tokens / t_ours:.0f}", f"{tokens / t_hf:.0f}", f"{t_hf / t_ours:.2f}", mfu])
    print()
    print(f"Training step throughput, {args.device}, {args.dtype}, median of {args.steps} steps")
    print(table(["model", "params", "batch", "ours s/step", "HF s/step", "ours tok/s", "HF tok/s",
                 "ratio ours/HF", "MFU"], rows))
    if args.device == "neuron":
        print(f"\nCompare a full node with NxD's published Llama 2 7B figure: about "
              f"{NXD_LLAMA2_7B_TOKENS_PER_NODE:,} tokens/s per trn1.32xlarge (TP 8, seq 4096, 32 NeuronCores; "
              f"{NXD_LLAMA2_7B_TOKENS_PER_NODE // 32:,} per core). These rows use one NeuronCore.")


if __name__ == "__main__":
    main()
