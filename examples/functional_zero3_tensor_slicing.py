"""The functional API with ZeRO-3 and tensor slicing: 4 ranks as 2 data x 2 tensor.

    fspeed --num_gpus 4 examples/functional_zero3_tensor_slicing.py
    torchrun --nproc_per_node 4 examples/functional_zero3_tensor_slicing.py --steps 50 --layers 2
    fspeed --num_gpus 4 examples/functional_zero3_tensor_slicing.py --steps 2 --layers 1 --width 32 --seq 16 --batch 2

Everything is a value: the mesh names its axes, the plan is two transforms composed with `|`
(tensor slicing splits the GPT's matmuls over `model`, ZeRO-3 partitions what is left over `data`),
`fs.explain` prints where each parameter lives and the bytes per rank, and a training step is
`state, metrics = train_step(state, batch)`. The model is the reference GPT on the Python standard
library's source (characters).
"""

import argparse

import torch

import fspeed as fs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per data rank and step")
    parser.add_argument("--checkpoint-dir", default="checkpoints/zero3_tp2")
    args = parser.parse_args()

    fs.init_distributed()                           # from the launcher's environment
    mesh = fs.Mesh(data=-1, model=2)                # 2 tensor ranks; the data axis takes the rest
    lead = mesh.rank == 0

    # Data: every rank reads the same text; each data rank draws its own share of the global batch
    # (the two tensor ranks of a data rank get the same rows)
    text = fs.data.stdlib_corpus(1_000_000)
    tokenizer = fs.data.CharTokenizer.from_text(text)
    train_tokens, val_tokens = fs.data.split_train_val(tokenizer.encode(text), 0.05)
    dp, rank = mesh.size("data"), mesh.coordinate("data")
    train_windows = fs.data.TokenWindows(train_tokens, args.seq)
    val_windows = fs.data.TokenWindows(val_tokens, args.seq)
    train = fs.data.Loader(train_windows, fs.data.BatchSampler(len(train_windows), args.batch * dp, seed=0,
                                                               rank=rank, world_size=dp))
    val = fs.data.Loader(val_windows, fs.data.BatchSampler(len(val_windows), args.batch * dp, seed=1, rank=rank,
                                                           world_size=dp)).eval_batches(4)

    vocab = fs.models.pad_vocab(tokenizer.vocab_size, 8 * mesh.size("model"))  # the vocabulary splits evenly
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=vocab, seq_len=args.seq, n_layer=args.layers, n_head=4,
                                              d_model=args.width))
    params = model.init(torch.Generator().manual_seed(0))  # every rank builds the same full tree once

    plan = fs.zero(3) | fs.tensor_slicing(fs.models.gpt_rules)
    if lead:
        print(fs.explain(plan, params, mesh, model.logical_axes))

    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0),
                         fs.optim.adamw(fs.optim.warmup_cosine(2e-3, total_num_steps=args.steps,
                                                               num_steps=max(1, args.steps // 10)), weight_decay=0.01))
    # the state holds only this rank's shards: ZeRO-3 of each tensor slice
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh, model=model)
    del params
    train_step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    evaluate = fs.make_eval_step(model.loss, plan=plan, mesh=mesh)

    def val_loss(s) -> float:
        return sum(evaluate(s, b) for b in val) / len(val)

    if lead:
        print(f"{mesh!r}: val loss at start {val_loss(state):.4f}")
    else:
        val_loss(state)  # a collective: every rank takes part
    every = max(1, args.steps // 5)
    while state.step < args.steps:
        state, metrics = train_step(state, train.batch(state.step))  # donates `state`: use the returned one
        if state.step % every == 0 or state.step == args.steps:
            current = val_loss(state)
            if lead:
                print(f"step {state.step}: loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f} "
                      f"lr {metrics['lr']:.2e} val {current:.4f}")

    # every rank writes its shard; the checkpoint loads into any other plan or mesh (or one process)
    path = fs.checkpoint.save_checkpoint(args.checkpoint_dir, state, mesh=mesh,
                                         client_state={"tokenizer": tokenizer.to_dict()})
    weights = fs.gather_params(state, mesh)  # the whole fp32 model on every rank (a collective)
    if lead:
        print(f"checkpoint: {path}; gathered {fs.models.count_params(weights):,} parameters")
    fs.shutdown_distributed()


if __name__ == "__main__":
    main()
