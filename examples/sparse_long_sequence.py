"""Long sequences with block-sparse attention: the reference GPT with `attention="sparse"` (a BigBird
layout: a sliding window, global and random blocks) against the same GPT with dense attention.

    python examples/sparse_long_sequence.py                        # S = 8192, about 2 minutes on 2 CPU cores
    python examples/sparse_long_sequence.py --seq 4096 --mode fixed
    python examples/sparse_long_sequence.py --seq 256 --block 16 --layers 1 --width 32 --reps 1   # tiny

For each it measures a training step's time and the bytes the forward keeps for backward
(`fs.measure_activations`); dense attention is measured as the GPT runs it (PyTorch's fused SDPA,
which keeps no S x S scores) and as plain attention computes it (the scores kept: SDPA's math
backend). Both models have the same parameters: the layout changes which scores are computed, not
the weights. The same layouts are DeepSpeed's `sparse_attention` config block
(`fspeed-train model.attention=sparse sparse_attention.mode=bigbird model.seq_len=8192`).
"""

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fspeed as fs


def step_time(model, params, batch, reps: int) -> float:
    """Median seconds of a training step (AdamW), after one warm-up step."""
    opt = fs.optim.adamw(1e-3)
    state = fs.init_train_state(params, opt, model=model)
    step = fs.make_train_step(model.loss, opt)
    state, _ = step(state, batch)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length")
    parser.add_argument("--mode", default="bigbird", choices=["bigbird", "fixed", "bslongformer", "variable"])
    parser.add_argument("--block", type=int, default=64, help="block size of the layout")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2, help="timed steps per model")
    args = parser.parse_args()

    sparse_config = fs.sparse.SparseAttentionConfig(mode=args.mode, block=args.block, attention="unidirectional",
                                                    num_random_blocks=1)
    common = dict(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.width)
    dense = fs.models.gpt(fs.models.GPTConfig(**common))
    sparse = fs.models.gpt(fs.models.GPTConfig(**common, attention="sparse", sparse_attention=sparse_config))
    params = dense.init(torch.Generator().manual_seed(0))  # the same tree serves both

    layout = fs.sparse.layout(sparse_config.to_sparsity_config(args.heads), seq_len=args.seq)
    blocks = layout.shape[-1]
    share, causal = fs.sparse.density(layout), (blocks + 1) / (2 * blocks)
    print(f"{args.mode} layout: {blocks} x {blocks} blocks of {args.block}; it computes {share:.3f} of the "
          f"S x S scores, dense causal attention {causal:.3f}")
    if blocks <= 16:
        print(fs.sparse.format_layout(layout[:1]))

    text = fs.data.ByteTokenizer().encode_bytes(fs.data.stdlib_corpus_bytes(args.seq + 65_536))[:args.seq + 1]
    batch = {"inputs": text[None, :-1], "targets": text[None, 1:]}  # one sequence of S bytes

    rows = []
    for name, model, backend in (("dense (fused SDPA)", dense, None), ("dense (scores kept)", dense, SDPBackend.MATH),
                                 ("block-sparse", sparse, None)):
        with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
            kept, _ = fs.measure_activations(model, params, batch)
            seconds = step_time(model, params, batch, args.reps)
        rows.append((name, kept, seconds))
        print(f"  {name:<22} {kept / 2**20:9.1f} MiB kept for backward {seconds * 1e3:9.1f} ms a step")
    (_, fused_kept, fused_s), (_, math_kept, math_s), (_, sparse_kept, sparse_s) = rows
    print(f"block-sparse at S={args.seq}: {fused_s / sparse_s:.2f}x faster than fused dense attention, "
          f"{math_s / sparse_s:.2f}x than plain attention, which keeps {math_kept / sparse_kept:.1f}x the bytes")


if __name__ == "__main__":
    main()
