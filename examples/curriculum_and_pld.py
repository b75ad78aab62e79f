"""Curriculum learning by sequence length and progressive layer dropping, on the reference GPT.

    python examples/curriculum_and_pld.py
    python examples/curriculum_and_pld.py --steps 2 --layers 2 --width 32 --seq 32 --batch 2   # tiny

Four runs of the same model, optimizer and data, the same number of steps: the baseline; a
curriculum (DeepSpeed's `fixed_linear`: short sequences first, growing to the full length over the
first half of the run); progressive layer dropping (step t keeps block l of L with probability
1 - (l / L)(1 - theta(t)), where theta(t) decays from 1 to `--theta`; dropped blocks do no work);
and both. Each run prints its training time, tokens seen and held-out loss.

Both are plain functions of the step here, applied to the batch: `fs.data.truncate_to_seqlen` cuts
it to the curriculum's length, and the GPT reads the step's `fs.models.step_layer_drop(...)` under
the batch's "layer_drop" key. DeepSpeed's config blocks do the same through `fs.initialize` or
`fspeed-train deepspeed_config=ds.json`:

    "curriculum_learning": {"enabled": true, "curriculum_type": "seqlen", "min_difficulty": 32,
        "max_difficulty": 128, "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 150, "difficulty_step": 8}},
    "progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.01}
"""

import argparse
import time

import torch

import fspeed as fs


def run(name, args, train, val, vocab, curriculum, pld):
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=vocab, seq_len=args.seq, n_layer=args.layers, n_head=4,
                                              d_model=args.width))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0),
                         fs.optim.adamw(fs.optim.warmup_cosine(2e-3, total_num_steps=args.steps,
                                                               num_steps=max(1, args.steps // 10)), weight_decay=0.01))
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, seed=0, model=model)
    step, evaluate = fs.make_train_step(model.loss, opt), fs.make_eval_step(model.loss)
    spent, tokens = 0.0, 0
    while state.step < args.steps:
        t = state.step
        batch = train.batch(t)
        if curriculum is not None:  # this step's sequence length
            batch = fs.data.truncate_to_seqlen(batch, fs.data.difficulty_at(curriculum, t))
        if pld:  # this step's keep ratio and draw (the same on every rank, and on resume)
            batch = {**batch, "layer_drop": fs.models.step_layer_drop(t, 0, args.theta, args.gamma)}
        tokens += batch["inputs"].numel()
        start = time.perf_counter()
        state, metrics = step(state, batch)
        spent += time.perf_counter() - start
    held_out = sum(evaluate(state, b) for b in val) / len(val)  # the full model, full-length sequences
    print(f"  {name:<22}{spent:>9.1f}{tokens:>12,}{held_out:>10.4f}")
    return spent, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--theta", type=float, default=0.5, help="PLD: the keep ratio theta decays to")
    parser.add_argument("--gamma", type=float, default=None, help="PLD: theta's decay rate (default 3 / steps)")
    args = parser.parse_args()
    args.gamma = args.gamma if args.gamma is not None else 3.0 / args.steps

    text = fs.data.stdlib_corpus(1_000_000)
    tokenizer = fs.data.CharTokenizer.from_text(text)
    train_tokens, val_tokens = fs.data.split_train_val(tokenizer.encode(text), 0.05)
    train_windows = fs.data.TokenWindows(train_tokens, args.seq)
    val_windows = fs.data.TokenWindows(val_tokens, args.seq)
    train = fs.data.Loader(train_windows, fs.data.BatchSampler(len(train_windows), args.batch, seed=0))
    val = fs.data.Loader(val_windows, fs.data.BatchSampler(len(val_windows), args.batch, seed=1)).eval_batches(4)
    vocab = fs.models.pad_vocab(tokenizer.vocab_size)

    # DeepSpeed's seqlen curriculum: from a quarter of the length to all of it over half the run
    curriculum = fs.data.CurriculumSchedule(min_difficulty=max(8, args.seq // 4), max_difficulty=args.seq,
                                            schedule_type="fixed_linear",
                                            total_curriculum_step=max(1, args.steps // 2), difficulty_step=8)
    print(f"{args.steps} steps of {args.batch} x {args.seq} tokens, {args.layers} blocks; curriculum "
          f"{curriculum.min_difficulty} -> {args.seq} tokens, PLD theta 1 -> {args.theta} (gamma {args.gamma:.3g})")
    print(f"  {'run':<22}{'train s':>9}{'tokens':>12}{'val loss':>10}")
    base, _ = run("baseline", args, train, val, vocab, None, False)
    for name, c, p in (("curriculum", curriculum, False), ("layer dropping", None, True),
                       ("curriculum + dropping", curriculum, True)):
        spent, _ = run(name, args, train, val, vocab, c, p)
        print(f"  {'':<22}{spent / base:>9.2f}x the baseline's time")


if __name__ == "__main__":
    main()
