"""Curriculum learning (sequence length) and progressive layer dropping on fspeed-train's default model.

The default job's model (char GPT: 4 layers, d_model 128, seq_len 128, micro-batch 16, AdamW) on
the standard-library corpus, one process. Three measurements, in one run:

1. step time keeping half of the blocks (a fixed `LayerDrop` whose draw keeps exactly 2 of 4)
   against the full model: `pld_step_time_at_keep_half` (theory: 0.5 plus embedding and head);
2. step time at a quarter of the maximum length (the curriculum's early steps) against the full
   length: `curriculum_early_step_time` (theory: below 0.25 for attention, plus fixed costs);
3. training to the baseline's validation loss: the baseline trains `--steps` steps; the curriculum
   run (fixed_linear 32 -> 128 over half the steps, difficulty_step 8) and the PLD run (theta 0.5,
   gamma 10/steps) train until their validation loss reaches the baseline's final one (checked
   every `--eval-every` steps, at most 3x the steps). All three share one lr schedule (warm-up, then
   cosine over 3x the steps), so a run that needs more steps still learns. Wall time counts
   training steps only.
   `curriculum_time_to_loss_vs_baseline`, `pld_time_to_loss_vs_baseline` (goal: <= 1).

Step times are the median of `--reps` timed steps after warm-up. Other processes on the machine
make single numbers noisy; the ratios come from interleaved measurements.

    python benchmarks/training_efficiency.py [--steps 300] [--threads 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fspeed as fs
from fspeed.data.curriculum import CurriculumSchedule, difficulty_at, truncate_to_seqlen
from fspeed.models.layer_drop import LayerDrop, kept_blocks, step_layer_drop
from fspeed.optim.schedules import warmup_cosine

SEQ, LAYERS, MICRO = 128, 4, 16


def corpus(max_bytes: int = 1_000_000):
    text = fs.data.stdlib_corpus(max_bytes)
    tokenizer = fs.data.make_tokenizer("char", text)
    train, val = fs.data.split_train_val(tokenizer.encode(text), 0.05, min_tokens=SEQ + 1)
    return tokenizer.vocab_size, fs.data.TokenWindows(train, SEQ), fs.data.TokenWindows(val, SEQ)


def setup(vocab: int, steps: int, seed: int = 0):
    cfg = fs.models.GPTConfig(vocab_size=fs.models.pad_vocab(vocab), seq_len=SEQ, n_layer=LAYERS, n_head=4,
                              d_model=128)
    model = fs.models.gpt(cfg)
    schedule = warmup_cosine(1e-3, steps, 0.1, min(50, steps // 10))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(schedule, weight_decay=0.01))
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(seed)), opt, seed=seed, model=model)
    return model, state, fs.make_train_step(model.loss, opt), fs.make_eval_step(model.loss)


def half_drop() -> LayerDrop:
    """A LayerDrop whose draw keeps exactly half of the blocks."""
    for seed in range(10_000):
        drop = LayerDrop(0.5, seed)
        if sum(s is not None for s in kept_blocks(drop, LAYERS)) == LAYERS // 2:
            return drop
    raise RuntimeError("no seed keeps half of the blocks")


def step_times(windows, vocab: int, reps: int) -> dict[str, float]:
    """Median step time of: full, half the blocks kept, a quarter of the length (interleaved)."""
    _, state, step, _ = setup(vocab, 10_000)
    loader = fs.data.Loader(windows, fs.data.BatchSampler(len(windows), MICRO, 0))
    drop = half_drop()
    variants = {
        "full": lambda b: b,
        "keep_half": lambda b: {**b, "layer_drop": drop},
        "quarter_length": lambda b: truncate_to_seqlen(b, SEQ // 4),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps + 3):
        for name, make in variants.items():
            batch = make(loader.batch(rep))
            start = time.perf_counter()
            state, _ = step(state, batch)
            if rep >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def time_to_loss(kind: str, windows, val_batches, vocab: int, steps: int, eval_every: int,
                 target: float | None) -> tuple[float, int, float]:
    """(training seconds, steps, final val loss) of `kind` until `target` (None: `steps` steps)."""
    _, state, step, evaluate = setup(vocab, 3 * steps)  # one lr schedule for all runs, long enough for the cap
    loader = fs.data.Loader(windows, fs.data.BatchSampler(len(windows), MICRO, 0))
    curriculum = CurriculumSchedule(min_difficulty=32, max_difficulty=SEQ, schedule_type="fixed_linear",
                                    total_curriculum_step=steps // 2, difficulty_step=8)
    spent, val = 0.0, float("inf")
    limit = steps if target is None else 3 * steps
    while state.step < limit:
        t = state.step
        batch = loader.batch(t)
        if kind == "curriculum":
            batch = truncate_to_seqlen(batch, difficulty_at(curriculum, t))
        elif kind == "pld":
            batch = {**batch, "layer_drop": step_layer_drop(t, 0, 0.5, 10.0 / steps)}
        start = time.perf_counter()
        state, _ = step(state, batch)
        spent += time.perf_counter() - start
        if state.step % eval_every == 0 or state.step == limit:
            val = sum(evaluate(state, b) for b in val_batches) / len(val_batches)
            if target is not None and val <= target:
                break
    return spent, state.step, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab, train, val = corpus()
    val_batches = fs.data.Loader(val, fs.data.BatchSampler(len(val), MICRO, 0)).eval_batches(8)

    times = step_times(train, vocab, args.reps)
    print(f"step time, default model (4 x d128, seq {SEQ}, micro-batch {MICRO}), {args.threads} threads, "
          f"median of {args.reps}:")
    print(f"  {'variant':<28}{'ms/step':>10}{'vs full':>10}")
    for name, label in (("full", "full model, full length"), ("keep_half", "PLD: 2 of 4 blocks kept"),
                        ("quarter_length", f"curriculum: length {SEQ // 4}")):
        print(f"  {label:<28}{times[name] * 1e3:>10.1f}{times[name] / times['full']:>10.2f}")

    base_time, base_steps, base_val = time_to_loss("baseline", train, val_batches, vocab, args.steps,
                                                   args.eval_every, None)
    rows = [("baseline", base_time, base_steps, base_val)]
    for kind in ("curriculum", "pld"):
        rows.append((kind, *time_to_loss(kind, train, val_batches, vocab, args.steps, args.eval_every, base_val)))
    print(f"\ntraining to the baseline's validation loss after {args.steps} steps ({base_val:.4f}):")
    print(f"  {'run':<12}{'train s':>10}{'steps':>8}{'val loss':>10}{'time vs baseline':>18}")
    for kind, spent, steps, loss in rows:
        print(f"  {kind:<12}{spent:>10.1f}{steps:>8}{loss:>10.4f}{spent / base_time:>18.2f}")
    reached = {kind: loss <= base_val for kind, _, _, loss in rows[1:]}
    print()
    print(f"pld_step_time_at_keep_half={times['keep_half'] / times['full']:.3f}")
    print(f"curriculum_early_step_time={times['quarter_length'] / times['full']:.3f}")
    for kind, spent, _, _ in rows[1:]:
        note = "" if reached[kind] else "  # did not reach the baseline's loss within 3x the steps"
        print(f"{kind}_time_to_loss_vs_baseline={spent / base_time:.3f}{note}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/training_efficiency.json

    with recorded("training_efficiency"):
        main()
