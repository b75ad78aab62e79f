"""Per-rank model-state memory under ZeRO 0-3, measured, beside the ZeRO paper's formula; and the
peak of gradient memory within a step.

A GPT of ~50M parameters trains on 4 gloo ranks for each stage (bf16 parameters and gradients,
fp32 masters and AdamW moments: the paper's mixed-precision Adam). Two tables:

1. What the state holds between steps, read off its actual buffers: parameters, the gradient
   buffers the runtime keeps (stage 0-1: the full accumulation buffer; stage 2: the fp32
   partition accumulator and its reduce buckets; stage 3: the shard accumulator), fp32 masters
   and optimizer moments; beside the ZeRO paper's formula (2 + 2 + K bytes per parameter, K = 12).
2. The peak of gradient bytes during a step, measured: every tensor storage allocated during the
   step is tracked (a TorchDispatchMode records each allocation, a finalizer its release); the
   parameter gradients autograd produces are recognised when they reach the gradient sink. The
   peak of (gradient buffers held + parameter gradients alive + storages the sink allocates
   itself) over the step is compared with what stage 2 promises: this rank's partition plus two
   reduce buckets (`reduce_bucket_size`, double-buffered with overlap_comm), i.e. no full
   gradient at any time.

    python benchmarks/zero_memory.py [--ranks 4] [--layers 16] [--d-model 512] [--bucket 10000000]

Last lines: zero3_bytes_per_rank_over_formula=<stage-3 bytes / (16 Psi / N + largest layer)>,
zero2_peak_grad_bytes_over_formula=<stage-2 peak gradient bytes / (partition + two buckets)>.
"""

from __future__ import annotations

import argparse
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fspeed as fs
from fspeed.testing import GlooWorld


def _storage_ptr(t: torch.Tensor):
    """The address of a tensor's storage; None where there is none to read (a storage freed to
    zero bytes, a collective's pending output)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class LiveStorages(TorchDispatchMode):
    """Every storage an op allocates during the mode, with its release (a finalizer), on one
    timeline of (allocation id, +bytes / -bytes); `owner` labels allocations made meanwhile."""

    def __init__(self):
        super().__init__()
        self.timeline: list[tuple[int, int]] = []
        self.by_ptr: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self.owner = ""
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            ptr = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
            if ptr is not None and t._base is None and ptr not in inputs:
                ident, nbytes = self._next, t.untyped_storage().nbytes()
                self._next += 1
                self.timeline.append((ident, nbytes))
                self.by_ptr[ptr] = ident
                if self.owner:
                    self.labels[ident] = self.owner
                weakref.finalize(t, self.timeline.append, (ident, -nbytes))
        return out

    def peak(self, label: str) -> int:
        """The peak of live bytes of the allocations labelled `label`."""
        live = peak = 0
        for ident, nbytes in self.timeline:
            if self.labels.get(ident) == label:
                live += nbytes
                peak = max(peak, live)
        return peak

    def peak_of(self, labels: set[str]) -> int:
        live = peak = 0
        for ident, nbytes in self.timeline:
            if self.labels.get(ident) in labels:
                live += nbytes
                peak = max(peak, live)
        return peak


def track_gradients(mode: LiveStorages) -> None:
    """Label what reaches the gradient sink as "param grad", and what the sink allocates as "sink"."""
    from fspeed.parallel.grads import GradSink
    from fspeed.torch_internals import unwrapped

    def labelled(method):
        def call(self, unit, grads):
            flat = [grads] if isinstance(grads, torch.Tensor) else grads
            for g in flat:
                if g is not None:
                    ident = mode.by_ptr.get(_storage_ptr(unwrapped(g)))
                    if ident is not None:
                        mode.labels[ident] = "param grad"
            previous, mode.owner = mode.owner, "sink"
            try:
                return method(self, unit, grads)
            finally:
                mode.owner = previous
        return call

    GradSink.deliver = labelled(GradSink.deliver)
    GradSink.deliver_shard = labelled(GradSink.deliver_shard)
    for name in ("end_micro", "finish"):
        original = getattr(GradSink, name)

        def owned(self, original=original):
            previous, mode.owner = mode.owner, "sink"
            try:
                return original(self)
            finally:
                mode.owner = previous
        setattr(GradSink, name, owned)


def measure(stage: int, layers: int, d_model: int, bucket: int) -> dict:
    """Build and step a state for one stage on this rank; bytes of every model-state buffer and the
    gradient peak within the second step."""
    mesh = fs.Mesh(data=-1)
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=64, n_layer=layers, n_head=8, d_model=d_model)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    opt = fs.optim.adamw(1e-4)
    plan = fs.zero(stage, reduce_bucket_size=bucket, overlap_comm=True)
    precision = fs.precision.bf16(grad_accum_dtype="bf16")  # the paper's 2-byte gradients
    state = fs.init_train_state(params, opt, precision=precision, plan=plan, mesh=mesh)
    del params
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    tokens = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(mesh.rank))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state, _ = step(state, batch)
    mode = LiveStorages()
    track_gradients(mode)
    with mode:
        state, _ = step(state, batch)
    layout = state.layout
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    largest = max((u.numel for u in layout.units if u.sharded), default=0)
    held = step.persistent_grad_bytes()
    return {
        "psi": layout.local.numel,
        "partition": layout.partition_numel,
        "params": nbytes(state.params.buffer),
        "grads": held,
        "master": nbytes(state.master.buffer),
        "optimizer": nbytes(state.opt_state.mu.buffer) + nbytes(state.opt_state.nu.buffer),
        "gathered": largest * 2 * (2 if layout.zero.prefetch else 1),
        "largest_layer_bytes": largest * 2,
        "peak_grads": held + mode.peak_of({"param grad", "sink"}),
        "peak_param_grads": mode.peak("param grad"),
        "peak_sink": mode.peak("sink"),
        "largest_allocation": max((b for _, b in mode.timeline), default=0),
    }


def paper_formula(stage: int, psi: int, n: int) -> float:
    """ZeRO paper, mixed-precision Adam (2 + 2 + K bytes per parameter, K = 12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--bucket", type=int, default=10_000_000, help="reduce_bucket_size (elements)")
    args = parser.parse_args()
    mb = 1 / 2**20
    rows = []
    with GlooWorld(args.ranks, timeout_s=900) as world:
        for stage in range(4):
            per_rank = world.run(measure, stage, args.layers, args.d_model, args.bucket)
            worst = max(per_rank, key=lambda r: r["peak_grads"])
            rows.append((stage, worst))
            print(f"  stage {stage} measured", flush=True)
    psi, n = rows[0][1]["psi"], args.ranks
    print(f"\nGPT {psi / 1e6:.1f}M parameters on {n} gloo ranks, bf16 params/grads + fp32 AdamW (MB per rank, "
          "the largest rank)")
    print(f"{'stage':<6}{'params':>9}{'grads':>9}{'master':>9}{'optim':>9}{'gathered':>10}{'total':>10}"
          f"{'formula':>10}{'ratio':>8}")
    ratio3 = None
    for stage, r in rows:
        total = r["params"] + r["grads"] + r["master"] + r["optimizer"] + r["gathered"]
        formula = paper_formula(stage, psi, n) + (r["largest_layer_bytes"] if stage == 3 else 0)
        ratio = total / formula
        ratio3 = ratio if stage == 3 else ratio3
        print(f"{stage:<6}{r['params'] * mb:>9.1f}{r['grads'] * mb:>9.1f}{r['master'] * mb:>9.1f}"
              f"{r['optimizer'] * mb:>9.1f}{r['gathered'] * mb:>10.1f}{total * mb:>10.1f}{formula * mb:>10.1f}"
              f"{ratio:>8.3f}")
    print("\nformula: 16Psi (stage 0), 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N + largest layer (stage 3);"
          " stage 3 'gathered' counts the computing layer and the prefetched next one")

    gb = 2  # bytes per gradient element (bf16)
    bucket_bytes = gb * args.bucket
    print(f"\nGradient memory within a step (MB per rank; reduce_bucket_size {args.bucket:,} elements, bf16, "
          "overlap_comm on, grad_accum 2; measured over the second step)")
    print(f"{'stage':<6}{'held':>9}{'param grads':>13}{'sink temp':>11}{'peak':>9}{'full grad':>11}{'peak/full':>11}")
    ratio2 = None
    for stage, r in rows:
        full = gb * psi
        print(f"{stage:<6}{r['grads'] * mb:>9.1f}{r['peak_param_grads'] * mb:>13.1f}{r['peak_sink'] * mb:>11.1f}"
              f"{r['peak_grads'] * mb:>9.1f}{full * mb:>11.1f}{r['peak_grads'] / full:>11.3f}")
        if stage == 2:
            buckets = 2 * min(bucket_bytes, gb * psi)
            promise = gb * r["partition"] + buckets
            ratio2 = r["peak_grads"] / promise
            print(f"       stage 2 promise: partition {gb * r['partition'] * mb:.1f} + two buckets {buckets * mb:.1f} "
                  f"= {promise * mb:.1f} MB; measured peak / promise {ratio2:.3f}")
    print("held: gradient buffers kept between steps; param grads: peak of the gradients autograd produced "
          "and the sink had not yet consumed; sink temp: storages the sink allocated; peak: the peak of their sum")
    print(f"zero3_bytes_per_rank_over_formula={ratio3:.3f}")
    print(f"zero2_peak_grad_bytes_over_formula={ratio2:.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/zero_memory.json

    with recorded("zero_memory"):
        main()
