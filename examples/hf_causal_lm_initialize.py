"""Fine-tune a Hugging Face causal LM through `fs.initialize`: a DeepSpeed config (ZeRO-3, bf16),
DeepSpeed's loop (engine(batch) / backward / step), a checkpoint, and the trained model saved
with `save_pretrained`.

    fspeed --num_gpus 2 examples/hf_causal_lm_initialize.py                 # 2 ranks (gloo on a CPU)
    torchrun --nproc_per_node 2 examples/hf_causal_lm_initialize.py --steps 200
    fspeed --num_gpus 2 examples/hf_causal_lm_initialize.py --layers 2 --width 32 --seq 16 --steps 2   # tiny

The model is a Llama built from a config (random weights, no download) with a byte vocabulary, so
it learns from the Python standard library's source read as bytes. ZeRO-3 partitions its
parameters, gradients and AdamW state over the ranks; the loss is `fs.causal_lm_loss`, which runs
the output head and the cross-entropy as one op (no logits kept for backward).
"""

import argparse
import os

import torch
import transformers

import fspeed as fs


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of `seq` bytes as causal-LM samples (labels = inputs; the loss shifts them)."""

    def __init__(self, data: torch.Tensor, seq: int):
        self.data, self.seq = data, seq

    def __len__(self):
        return len(self.data) // self.seq

    def __getitem__(self, i):
        window = self.data[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": window, "labels": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256, help="hidden size")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default="checkpoints/hf_llama")
    parser.add_argument("--save-dir", default="hf_llama_trained", help="where save_pretrained writes the model")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    # A Llama from its config: random weights, byte vocabulary
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(config)

    # the standard library's source as bytes: enough for the run (every rank reads the same text, the
    # loader gives each its share), and 64 held-out windows
    world = int(os.environ.get("WORLD_SIZE", "1"))
    needed = (2 * args.steps * args.grad_accum * args.micro_batch * world + 64) * args.seq
    data = fs.data.ByteTokenizer().encode_bytes(fs.data.stdlib_corpus_bytes(min(needed, 20_000_000) + 65_536))
    train, held_out = ByteWindows(data[:-64 * args.seq], args.seq), ByteWindows(data[-64 * args.seq:], args.seq)

    # Any DeepSpeed config (a dict or a JSON file): its keys are translated and checked
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 2e-3, "total_num_steps": args.steps,
                                                          "warmup_num_steps": max(1, args.steps // 10)}},
        "steps_per_print": max(1, args.steps // 10),
    }
    engine, optimizer, loader, scheduler = fs.initialize(model=model, config=ds_config, training_data=train,
                                                         loss_fn=fs.causal_lm_loss)
    lead = engine.global_rank == 0
    probe = {k: torch.stack([held_out[i][k] for i in range(args.micro_batch)]) for k in ("input_ids", "labels")}
    start = engine.eval_batch(probe)  # every rank calls it: ZeRO-3 gathers the layers
    if lead:
        print(f"{engine.world_size} ranks, ZeRO-{engine.zero_optimization_stage()}, bf16; held-out loss {start:.3f}")

    # DeepSpeed's loop: each `for` over the loader is one epoch of this rank's share
    while engine.global_steps < args.steps:
        for batch in loader:
            loss = engine(batch)      # forward and backward of one micro-batch
            engine.backward(loss)
            engine.step()             # the update, at the accumulation boundary
            if engine.global_steps == args.steps:
                break

    end = engine.eval_batch(probe)
    path = engine.save_checkpoint(args.checkpoint_dir, client_state={"note": "resume with engine.load_checkpoint"})
    trained = engine.module  # the Llama with the trained weights (gathered from every rank: all ranks call it)
    if lead:
        trained.save_pretrained(args.save_dir)
        print(f"held-out loss {start:.3f} -> {end:.3f} after {engine.global_steps} steps")
        print(f"checkpoint: {path}; model: {args.save_dir} (transformers.LlamaForCausalLM.from_pretrained)")
    fs.shutdown_distributed()


if __name__ == "__main__":
    main()
