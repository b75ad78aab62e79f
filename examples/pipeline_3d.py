"""3D parallelism on 8 ranks: a Hugging Face Llama over 2 pipeline stages x 2 data ranks x 2 tensor
ranks, with the 1F1B schedule.

    fspeed --num_gpus 8 examples/pipeline_3d.py
    torchrun --nproc_per_node 8 examples/pipeline_3d.py --steps 50 --schedule zero_bubble
    fspeed --num_gpus 8 examples/pipeline_3d.py --steps 2 --layers 2 --width 32 --seq 16 --batch 4   # tiny

`fs.models.decoder_layers(llama)` turns the module into its layers (embedding, decoder layers, final
norm, head) with the model's own tensor-parallel plan; the plan slices each layer over `model`,
cuts the layers into stages over `pipe` and runs ZeRO-1 over `data`. The Llama is built from a
config (random weights, no download) with a byte vocabulary and learns from the Python standard
library's source. At the end the trained weights go back into the Hugging Face module.
"""

import argparse

import torch
import transformers

import fspeed as fs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per data rank and step")
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble"])
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    fs.init_distributed()
    mesh = fs.Mesh(data=-1, model=2, pipe=2)  # 8 ranks: data 2 x model 2 x pipe 2
    lead = mesh.rank == 0

    torch.manual_seed(0)  # every rank builds the same random Llama
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq))
    # the head and the loss as one op on the last stage (over the head's vocabulary slices)
    model = fs.models.decoder_layers(llama, loss_fn=fs.causal_lm_loss)
    params = model.init()

    plan = (fs.zero(1)
            | fs.tensor_slicing(fs.models.module_tp_rules)  # the layers' tp_plan styles
            | fs.pipeline(micro_batches=args.micro_batches, schedule=args.schedule))
    if lead:
        print(fs.explain(plan, params, mesh, model.logical_axes, layers=model.layers))
        print(fs.parallel.show_schedule(plan, mesh))

    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(2e-3, weight_decay=0.01))
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh, model=model)
    train_step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)  # a pipeline takes the Model itself

    # Data: byte windows of the standard library; each data rank takes its share of the global batch,
    # and every stage and tensor rank of that data rank the same rows
    dp, rank = mesh.size("data"), mesh.coordinate("data")
    rows = args.batch * dp
    tokens = fs.data.ByteTokenizer().encode_bytes(fs.data.stdlib_corpus_bytes(args.steps * rows * args.seq + 65_536))
    windows = tokens[:args.steps * rows * args.seq].view(args.steps, rows, args.seq)
    held_out = tokens[-8 * args.seq:].view(8, args.seq)

    for i in range(args.steps):
        share = windows[i, rank * args.batch:(rank + 1) * args.batch]
        state, metrics = train_step(state, {"input_ids": share, "labels": share})
        if lead and ((i + 1) % max(1, args.steps // 10) == 0 or i == 0):
            print(f"step {state.step}: loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f}")

    # The trained weights back under the Hugging Face module's own names (a collective: every rank)
    fs.models.decoder_layers_to_module(fs.gather_params(state, mesh), llama)
    if lead:
        with torch.no_grad():
            loss = llama(input_ids=held_out, labels=held_out).loss
        print(f"the Hugging Face module with the trained weights: held-out loss {loss:.4f}")
    fs.shutdown_distributed()


if __name__ == "__main__":
    main()
