"""ZeRO-Offload: the fp32 master weights and AdamW moments of each rank's partition live in CPU
memory and are updated there by fspeed's Numba CPU Adam (one pass: bf16 gradients in, bf16
parameters out); with ZeRO-3 and `--offload-param` the parameter shards live there too.

    python examples/zero_offload.py                                      # one process, ZeRO-2 + CPU Adam
    fspeed --num_gpus 2 examples/zero_offload.py --stage 3 --offload-param
    fspeed --num_gpus 2 examples/zero_offload.py --device cuda           # on GPUs: the device keeps bf16 params + grads
    python examples/zero_offload.py --steps 2 --layers 1 --width 32 --seq 16 --batch 2   # tiny

It trains the reference GPT twice from the same start, with and without offload, prints the memory
estimate of both placements (this model, and a 1.3B-parameter one on 8 ranks), where the state
lives, the step times, and checks that both runs end with the same weights. On a CPU-only machine
the "device" is the CPU too, so the memory moves nowhere; on a GPU the device keeps only the 16-bit
parameters and gradients.
"""

import argparse
import os
import statistics
import time

import torch

import fspeed as fs


def offload_plan(stage: int, offload: bool, offload_param: bool) -> fs.Plan:
    return fs.zero(stage, offload_optimizer="cpu" if offload else "none",
                   offload_param="cpu" if offload and offload_param else "none")


def train(model, params, plan, mesh, batches, device):
    """Train on `batches` under `plan`; the state, the losses and the median step time."""
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3, weight_decay=0.01))
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh, model=model,
                                device=device)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    losses, times = [], []
    for batch in batches:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])  # a float: the step has finished
        times.append(time.perf_counter() - start)
    return state, losses, statistics.median(times[1:] or times)  # the first step warms up (and compiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage")
    parser.add_argument("--offload-param", action="store_true", help="ZeRO-3: parameter shards on the CPU too")
    parser.add_argument("--device", default="cpu", help="where the model computes: cpu or cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    args = parser.parse_args()
    if args.offload_param and args.stage != 3:
        parser.error("--offload-param needs --stage 3")

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fs.init_distributed()
    mesh = fs.Mesh(data=-1)  # every rank a data rank (one process: a mesh of one)
    dp, rank, lead = mesh.size("data"), mesh.coordinate("data"), mesh.rank == 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else None

    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=6
                                              if args.width % 6 == 0 else 4, d_model=args.width))
    params = model.init(torch.Generator().manual_seed(0))
    needed = args.steps * args.batch * dp * (args.seq + 1)
    tokens = fs.data.ByteTokenizer().encode_bytes(fs.data.stdlib_corpus_bytes(needed + 65_536))[:needed]
    rows = tokens.view(args.steps, args.batch * dp, args.seq + 1)[:, rank * args.batch:(rank + 1) * args.batch]
    batches = [{"inputs": r[:, :-1], "targets": r[:, 1:]} for r in rows]  # this rank's share of each step

    plain, offloaded = (offload_plan(args.stage, o, args.offload_param) for o in (False, True))
    if lead:
        for plan in (plain, offloaded):
            print(fs.estimate_memory(params, plan, {"data": dp}, "bf16", logical_axes=model.logical_axes))
        print("the same placements for a 1.3B-parameter model on 8 ranks:")
        for plan in (plain, offloaded):
            print(fs.estimate_memory(1_300_000_000, plan, {"data": 8}, "bf16"))

    state_a, losses_a, time_a = train(model, params, plain, mesh, batches, device)
    state_b, losses_b, time_b = train(model, params, offloaded, mesh, batches, device)
    adam = state_b.opt_state[1]  # (clipping's state, AdamW's state)
    same = torch.equal(fs.Flat.from_tree(fs.gather_params(state_a, mesh)).buffer,
                       fs.Flat.from_tree(fs.gather_params(state_b, mesh)).buffer)  # a collective: every rank
    if lead:
        print(f"offloaded: params on {state_b.params.buffer.device}, fp32 masters on {state_b.master.buffer.device}, "
              f"AdamW moments on {adam.mu.buffer.device} (pinned: {adam.mu.buffer.is_pinned()})")
        print(f"loss {losses_a[0]:.4f} -> {losses_a[-1]:.4f} without offload, {losses_b[0]:.4f} -> {losses_b[-1]:.4f} "
              f"with; the same weights after {args.steps} steps: {same}")
        print(f"step time: {time_a * 1e3:.1f} ms without offload, {time_b * 1e3:.1f} ms with")
    fs.shutdown_distributed()
    if not same:
        raise SystemExit("offloaded training did not end with the same weights")


if __name__ == "__main__":
    main()
