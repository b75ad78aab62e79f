"""TP2 on 2 gloo ranks (one thread each): a Hugging Face Llama (random init, no download) tensor-sliced
by its own tp_plan, by fspeed and by PyTorch's `parallelize_module`, on the same model and data,
alternating step by step in one run.

    fspeed             fs.functionalize(llama, loss, tp_plan="auto") under fs.tensor_slicing(module_tp_rules):
                       the module's own loss (its head's logits gathered, as torch's)
    fspeed fused head  the same with fs.causal_lm_loss: the head fused with the loss, computed over
                       the head's vocabulary slices (no logits kept or gathered)
    torch              `parallelize_module` on a 1-D DeviceMesh with the same plan (ColwiseParallel /
                       RowwiseParallel as the tp_plan says, the head colwise with its logits gathered; the
                       embedding whole, as the plan leaves it), the module's own loss,
                       torch.optim.AdamW(foreach=True; one for the DTensor parameters, one for the rest)

Each step: a barrier, the engine's whole step (forward, backward, AdamW), the slower rank's time.
The first step's losses are printed side by side.

    python benchmarks/tensor_parallel.py [--layers 8] [--width 256] [--seq 128] [--rows 8] [--steps 8]

Last lines: tensor_parallel_step_time_vs_torch (median over steps of fspeed's time over torch's in the
same round), tensor_parallel_fused_head_step_time_vs_torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fspeed as fs
from fspeed.testing import GlooWorld

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_tp import VOCAB, alternate, build_llama, report  # noqa: E402 (the PP x TP benchmark's Llama and timing)

def make_batch(args: argparse.Namespace, step: int) -> dict:
    ids = torch.randint(0, VOCAB, (args.rows, args.seq), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def fspeed_engine(args: argparse.Namespace, fused: bool):
    loss_fn = fs.causal_lm_loss if fused else (lambda outputs, batch: outputs.loss)
    model = fs.functionalize(build_llama(args), loss_fn, tp_plan="auto")
    mesh = fs.Mesh(data=1, model=2)
    plan = fs.tensor_slicing(fs.models.module_tp_rules)
    opt = fs.optim.adamw(1e-4)
    box = {"state": fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)}
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)

    def run(batch: dict) -> float:
        box["state"], metrics = step(box["state"], batch)
        return float(metrics["loss"])
    return run


def torch_engine(args: argparse.Namespace):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    llama = build_llama(args)
    mesh = init_device_mesh("cpu", (2,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}  # colwise_gather_output: the logits gathered
    for pattern, style in fs.tp_plan_from(llama).items():
        if pattern.startswith("model.layers.*."):
            for i in range(len(llama.model.layers)):
                plan[pattern.replace("*", str(i), 1)] = styles[style]()
    parallelize_module(llama, mesh, plan)
    sliced = [p for p in llama.parameters() if isinstance(p, DTensor)]
    whole = [p for p in llama.parameters() if not isinstance(p, DTensor)]
    opts = [torch.optim.AdamW(group, lr=1e-4, weight_decay=0.0, foreach=True) for group in (sliced, whole) if group]

    def run(batch: dict) -> float:
        loss = llama(**batch).loss
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return run


def compare(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    fs.retain_freed_host_memory()
    runs = {"fspeed": fspeed_engine(args, fused=False), "fspeed fused head": fspeed_engine(args, fused=True),
            "torch": torch_engine(args)}
    return alternate(runs, args, make_batch)


def main(args: argparse.Namespace) -> None:
    with GlooWorld(2, timeout_s=1800) as world:
        results = world.run(compare, args)
    params = sum(p.numel() for p in build_llama(args).parameters())
    report(results[0]["times"], results[0]["first_loss"],
           f"Hugging Face Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, width {args.width}, vocabulary "
           f"{VOCAB}), TP2 on 2 gloo ranks x 1 thread by its own tp_plan, {args.rows} x {args.seq} tokens, AdamW; "
           f"median of {args.steps} steps after {args.warmup}, slower rank", "tensor_parallel")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/tensor_parallel.json

    with recorded("tensor_parallel"):
        main(parse_args())
