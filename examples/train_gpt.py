"""Train the reference GPT on the Python standard library's source, with the Python API only.

    python examples/train_gpt.py --steps 200 --precision bf16

The same loop `fspeed-train` runs, without Hydra: data, model, optimizer chain, train_step,
periodic evaluation and a checkpoint at the end.
"""

import argparse

import torch

import fspeed as fs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--checkpoint-dir", default="checkpoints/example")
    args = parser.parse_args()

    text = fs.data.stdlib_corpus(2_000_000)
    tokenizer = fs.data.CharTokenizer.from_text(text)
    train_tokens, val_tokens = fs.data.split_train_val(tokenizer.encode(text), 0.05)
    seq_len = 128
    train_windows = fs.data.TokenWindows(train_tokens, seq_len)
    val_windows = fs.data.TokenWindows(val_tokens, seq_len)
    train = fs.data.Loader(train_windows, fs.data.BatchSampler(len(train_windows), args.batch * args.grad_accum, seed=0))
    val = fs.data.Loader(val_windows, fs.data.BatchSampler(len(val_windows), args.batch, seed=0)).eval_batches(4)

    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=seq_len,
                                              n_layer=4, n_head=4, d_model=128))
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),
        fs.optim.adamw(fs.optim.warmup_cosine(2e-3, total_num_steps=args.steps, num_steps=20,
                                              warmup_type="linear", cos_min_ratio=0.1), weight_decay=0.01),
    )
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt,
                                precision=getattr(fs.precision, args.precision)())
    train_step = fs.make_train_step(model.loss, opt, grad_accum=args.grad_accum)
    evaluate = fs.make_eval_step(model.loss)

    def val_loss(s) -> float:
        return sum(evaluate(s, b) for b in val) / len(val)

    print(f"val loss at start {val_loss(state):.4f}")
    while state.step < args.steps:
        state, metrics = train_step(state, train.batch(state.step))
        if state.step % 50 == 0 or state.step == args.steps:
            print(f"step {state.step}: loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
                  f"grad_norm {metrics['grad_norm']:.3f} val {val_loss(state):.4f}")
    path = fs.save_checkpoint(args.checkpoint_dir, state, client_state={"tokenizer": tokenizer.to_dict()})
    print(f"checkpoint: {path}")


if __name__ == "__main__":
    main()
