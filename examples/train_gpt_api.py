"""Train the reference GPT on the Python standard library's source, with the Python API only.

    python examples/train_gpt_api.py --steps 200 --precision bf16
    fspeed --num_gpus 4 examples/train_gpt_api.py --zero-stage 3 --tensor 2     # DP=2 x TP=2

The same loop `fspeed-train` runs, without Hydra: data, model, optimizer chain, a parallel plan,
train_step, periodic evaluation and the final weights.
"""

import argparse
import os

import torch

import fspeed as fs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--tensor", type=int, default=1, help="tensor-slicing degree")
    parser.add_argument("--checkpoint-dir", default="checkpoints/example")
    args = parser.parse_args()

    mesh = plan = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or args.zero_stage or args.tensor > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            fs.init_distributed()
        mesh = fs.Mesh(data=-1, model=args.tensor)
        plan = fs.zero(stage=args.zero_stage)
        if args.tensor > 1:
            plan = plan | fs.tensor_slicing(fs.models.gpt_rules)
    rank, dp = (mesh.coordinate("data"), mesh.size("data")) if mesh else (0, 1)
    lead = mesh is None or mesh.rank == 0

    text = fs.data.stdlib_corpus(2_000_000)
    tokenizer = fs.data.CharTokenizer.from_text(text)
    train_tokens, val_tokens = fs.data.split_train_val(tokenizer.encode(text), 0.05)
    seq_len = 128
    train_windows = fs.data.TokenWindows(train_tokens, seq_len)
    val_windows = fs.data.TokenWindows(val_tokens, seq_len)
    train = fs.data.Loader(train_windows, fs.data.BatchSampler(len(train_windows), args.batch * args.grad_accum * dp,
                                                               seed=0, rank=rank, world_size=dp))
    val = fs.data.Loader(val_windows, fs.data.BatchSampler(len(val_windows), args.batch * dp, seed=0, rank=rank,
                                                           world_size=dp)).eval_batches(4)

    vocab = fs.models.pad_vocab(tokenizer.vocab_size, 8 * args.tensor)  # tensor slicing splits it evenly
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=vocab, seq_len=seq_len,
                                              n_layer=4, n_head=4, d_model=128))
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),
        fs.optim.adamw(fs.optim.warmup_cosine(2e-3, total_num_steps=args.steps, num_steps=20,
                                              warmup_type="linear", cos_min_ratio=0.1), weight_decay=0.01),
    )
    params = model.init(torch.Generator().manual_seed(0))
    state = fs.init_train_state(params, opt, precision=getattr(fs.precision, args.precision)(), plan=plan,
                                mesh=mesh, logical_axes=model.logical_axes)
    if lead and plan is not None:
        print(fs.explain(plan, params, mesh, model.logical_axes))
    train_step = fs.make_train_step(model.loss, opt, grad_accum=args.grad_accum, plan=plan, mesh=mesh)
    evaluate = fs.make_eval_step(model.loss, plan=plan, mesh=mesh)

    def val_loss(s) -> float:
        return sum(evaluate(s, b) for b in val) / len(val)

    start = val_loss(state)
    if lead:
        print(f"val loss at start {start:.4f}")
    while state.step < args.steps:
        state, metrics = train_step(state, train.batch(state.step))
        if state.step % 50 == 0 or state.step == args.steps:
            current = val_loss(state)
            if lead:
                print(f"step {state.step}: loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
                      f"grad_norm {metrics['grad_norm']:.3f} val {current:.4f}")
    # Resumable: with a mesh every rank writes its own shard (fs.checkpoint.load_checkpoint(..., mesh=mesh) reads it)
    path = fs.checkpoint.save_checkpoint(args.checkpoint_dir, state, client_state={"tokenizer": tokenizer.to_dict()},
                                         mesh=mesh)
    if lead:
        print(f"checkpoint: {path}")
    if mesh is not None:
        weights = fs.gather_params(state, mesh)  # full fp32 weights, for use anywhere; every rank takes part
        if lead:
            torch.save(weights, "gpt_weights.pt")
            print("full fp32 weights gathered from all ranks: gpt_weights.pt")
    fs.shutdown_distributed()  # leave together (a no-op on one process)


if __name__ == "__main__":
    main()
