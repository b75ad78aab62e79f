"""PP2 x TP2 on 4 gloo ranks (one thread each): a Hugging Face Llama (random init, no download)
pipelined over 2 stages and tensor-sliced over 2 ranks by fspeed and by PyTorch's own composition,
on the same model, stages, micro-batches and data, alternating step by step in one run.

    fspeed             fs.models.decoder_layers(llama) (its layers and Hugging Face's tp_plan), under
                       fs.tensor_slicing(module_tp_rules) | fs.pipeline(M, "1f1b", "uniform");
                       the head colwise with its logits gathered, then the loss (as torch's)
    fspeed fused head  the same with the head fused with causal_lm_loss: the vocabulary-parallel loss
                       over the head's slices, no logits kept or gathered (fspeed's default)
    torch              the same layers per stage, `parallelize_module` (ColwiseParallel/RowwiseParallel
                       as the tp_plan says, the embedding row-parallel, the head's logits gathered)
                       on a 2-D DeviceMesh, `torch.distributed.pipelining`'s PipelineStage and
                       Schedule1F1B, torch.optim.AdamW(foreach=True; one for the sliced DTensor parameters, one for the rest)

Every rank builds the same Llama; the ranks' mesh coordinates agree (rank = 2 x stage + tensor
rank in both). Each step: a barrier, the engine's whole step (schedule and AdamW), the slowest
rank's time. The first step's losses are printed side by side (the same math: they agree to
rounding).

    python benchmarks/pipeline_tp.py [--layers 8] [--width 256] [--seq 128] [--rows 4] [--micro-batches 4] [--steps 8]

4 ranks share this machine's 2 cores: the ratios hold for engines that alternate in one run, not
the absolute times. Last lines: pipeline_tp_step_time_vs_torch (median over steps of fspeed's
time over torch's in the same round), pipeline_tp_fused_head_step_time_vs_torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fspeed as fs
from fspeed.testing import GlooWorld

VOCAB = 4096
ENGINES = ("fspeed", "fspeed fused head", "torch")


def build_llama(args: argparse.Namespace):
    import transformers
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    for owner in (utils, import_utils):  # this repository's kernels/ folder is not Hugging Face's package
        owner.is_kernels_available = lambda *a, **k: False
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=args.width, intermediate_size=args.width * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.width // 32,
                                   num_key_value_heads=args.width // 64, vocab_size=VOCAB,
                                   max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def make_batch(args: argparse.Namespace, step: int) -> dict:
    ids = torch.randint(0, VOCAB, (args.rows * args.micro_batches, args.seq),
                        generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """causal_lm_loss's math on whole logits: position t predicts token t + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def fspeed_engine(args: argparse.Namespace, fused: bool):
    loss_fn = fs.causal_lm_loss if fused else (lambda logits, batch: shifted_loss(logits, batch["labels"]))
    model = fs.models.decoder_layers(build_llama(args), loss_fn=loss_fn)
    mesh = fs.Mesh(data=1, model=2, pipe=2)
    plan = fs.tensor_slicing(fs.models.module_tp_rules) | fs.pipeline(args.micro_batches, "1f1b", "uniform")
    opt = fs.optim.adamw(1e-4)
    box = {"state": fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)}
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)

    def run(batch: dict) -> float:
        box["state"], metrics = step(box["state"], batch)
        return float(metrics["loss"])
    return run, list(box["state"].layout.pipeline.bounds)


class StageModule(nn.Module):
    """Layers [lo, hi) of the Llama as the pipeline stage torch runs: the embedding, decoder layers
    (`DecoderBlock`, as fspeed runs them), the final norm, the head."""

    def __init__(self, layers: list, lo: int, hi: int):
        super().__init__()
        self.layers = nn.ModuleList(layers[lo:hi])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def torch_engine(args: argparse.Namespace, bounds: list[int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fspeed.models.decoder_layers import DecoderBlock

    llama = build_llama(args)
    body = llama.model
    implicit = llama.config._attn_implementation == "sdpa"
    layers = [body.embed_tokens, *[DecoderBlock(b, body.rotary_emb, implicit) for b in body.layers], body.norm,
              llama.lm_head]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh["pp"].get_local_rank()
    module = StageModule(layers, bounds[stage], bounds[stage + 1])
    plan = {}
    for i, layer in enumerate(module.layers):
        if isinstance(layer, DecoderBlock):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"layers.{i}.layer.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"layers.{i}.layer.{name}"] = RowwiseParallel()
        elif layer is body.embed_tokens:
            plan[f"layers.{i}"] = RowwiseParallel(input_layouts=Replicate())  # vocabulary-parallel
        elif layer is llama.lm_head:
            plan[f"layers.{i}"] = ColwiseParallel(output_layouts=Replicate())  # the logits gathered
    parallelize_module(module, mesh["tp"], plan)
    pipe_stage = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe_stage, args.micro_batches, loss_fn=shifted_loss)
    # foreach AdamW takes DTensors or plain tensors, not both in one call: one optimizer for each kind
    sliced = [p for p in module.parameters() if isinstance(p, DTensor)]
    whole = [p for p in module.parameters() if not isinstance(p, DTensor)]
    opts = [torch.optim.AdamW(group, lr=1e-4, weight_decay=0.0, foreach=True) for group in (sliced, whole) if group]

    def run(batch: dict) -> float:
        out: list = []
        if stage == 0:
            schedule.step(batch["input_ids"])
        else:
            schedule.step(target=batch["labels"], losses=out)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(torch.stack(out).detach().mean()) if out else float("nan")
    return run


def alternate(runs: dict, args: argparse.Namespace, batch_for: Callable[[argparse.Namespace, int], dict]) -> dict:
    """Each engine's whole step in turn on the same batch, the order rotating step by step: a barrier
    before each, the slowest rank's seconds (after `args.warmup` steps), and the first step's losses."""
    times = {name: [] for name in runs}
    first = {}
    for i in range(args.warmup + args.steps):
        batch = batch_for(args, i)
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = runs[name](batch)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i == 0:
                first[name] = loss
            if i >= args.warmup:
                times[name].append(float(elapsed))
    return {"times": times, "first_loss": first}


def report(times: dict, first: dict, title: str, figure: str) -> None:
    """The table (each engine's median step, its ratio to torch's, its first loss) and the
    `{figure}_step_time_vs_torch` and `{figure}_fused_head_step_time_vs_torch` lines."""
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["torch"])) for name in times}
    print(title)
    print(f"\n  {'engine':<22}{'step':>10}{'over torch':>12}{'first loss':>12}")
    for name in ENGINES:
        print(f"  {name:<22}{med[name] * 1e3:>8.0f} ms{ratio[name]:>12.3f}{first[name]:>12.5f}")
    print("\n(each ratio: the median over steps of the two engines' times in the same round)")
    print(f"{figure}_step_time_vs_torch={ratio['fspeed']:.3f}")
    print(f"{figure}_fused_head_step_time_vs_torch={ratio['fspeed fused head']:.3f}")


def compare(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    fs.retain_freed_host_memory()
    plain, bounds = fspeed_engine(args, fused=False)
    fused, _ = fspeed_engine(args, fused=True)
    runs = {"fspeed": plain, "fspeed fused head": fused, "torch": torch_engine(args, bounds)}
    return {**alternate(runs, args, make_batch), "bounds": bounds}


def main(args: argparse.Namespace) -> None:
    with GlooWorld(4, timeout_s=1800) as world:
        results = world.run(compare, args)
    params = sum(p.numel() for p in build_llama(args).parameters())
    # the last stage's ranks (2, 3) report the loss
    report(results[0]["times"], results[-1]["first_loss"],
           f"Hugging Face Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, width {args.width}, vocabulary "
           f"{VOCAB}), PP2 x TP2 on 4 gloo ranks x 1 thread, stages {results[0]['bounds']} of its layers, "
           f"{args.micro_batches} micro-batches of {args.rows} x {args.seq} tokens, 1F1B, AdamW; median of {args.steps} "
           f"steps after {args.warmup}, slowest rank", "pipeline_tp")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/pipeline_tp.json

    with recorded("pipeline_tp"):
        main(parse_args())
