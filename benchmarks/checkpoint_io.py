"""Checkpoint I/O: fspeed's layout-free save beside `torch.distributed.checkpoint.save` and a raw
sequential write, and the memory of a resharding load; a GPT of >= 100M parameters with AdamW
state (fp32) on 2 gloo ranks.

One run, per round (same disk, same bytes; each round starts with the next writer of the four):

1. fspeed `save_checkpoint` of a ZeRO-3 state (every rank writes its boxes, checksums, publishes
   atomically), `dcp.save` of the same per-rank buffers (its FileSystemWriter, fsynced), a raw
   write of each rank's file size from one buffer (fsynced), and fspeed's background save
   (`blocking=False`): the time until training could go on (the copy to host memory) and the
   time its thread took to publish. Wall times of the slowest rank.
2. A resharding load: a ZeRO-1 checkpoint loaded into a ZeRO-3 state on the same 2 ranks; each
   rank's peak resident memory during the load (Linux VmHWM, reset first) over its state's bytes
   (its shard: what it must read). The template is allocated before the measurement starts.

    python benchmarks/checkpoint_io.py [--layers 12] [--d-model 768] [--vocab 32000] [--rounds 12]

Last lines: save_time_vs_dcp=<fspeed save s / dcp save s, median of rounds>,
save_time_vs_dcp_fastest_rounds=<the same of each writer's fastest round: this machine's disk stalls
every few seconds for ~1.5 s, which a write of the same bytes meets or not>,
reshard_load_peak_over_shard=<max over ranks of peak extra bytes / shard bytes>,
save_bandwidth_fraction=<fspeed bytes/s over raw sequential write bytes/s>,
async_save_stall_over_blocking_save=<time until training goes on with blocking=False / a blocking save>.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fspeed as fs
from fspeed.testing import GlooWorld


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _state(layers: int, d_model: int, vocab: int, stage: int, mesh):
    cfg = fs.models.GPTConfig(vocab_size=vocab, seq_len=256, n_layer=layers, n_head=12, d_model=d_model)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    opt = fs.optim.adamw(1e-4)
    state = fs.init_train_state(params, opt, plan=fs.zero(stage), mesh=mesh, logical_axes=model.logical_axes)
    psi = sum(math.prod(p.shape) for p in state.layout.params)
    # Adam moments as after training (non-zero: same bytes, realistic content)
    for flat in (state.opt_state.mu, state.opt_state.nu):
        flat.buffer.copy_(torch.randn(flat.buffer.shape, generator=torch.Generator().manual_seed(mesh.rank)).abs_())
    del params
    return state, psi


def _buffers(state) -> dict[str, torch.Tensor]:
    """Every tensor of the rank's state by key (what DCP saves for it)."""
    tensors, _ = fs.checkpoint.state_entries(state)
    return tensors


def _barrier_time(mesh, fn) -> float:
    """Wall time of `fn` on the slowest rank (all start together, once the page cache holds no dirty
    data: a write would otherwise wait on the writeback of the one before it)."""
    os.sync()
    mesh.all_gather_objects(None, "bench start")
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    return max(mesh.all_gather_objects(elapsed, "bench time"))


def _raw_write(path: Path, nbytes: int) -> None:
    block = torch.zeros(64 << 20, dtype=torch.uint8).numpy()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(memoryview(block)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def measure(root: str, layers: int, d_model: int, vocab: int, rounds: int) -> dict:
    import torch.distributed.checkpoint as dcp

    mesh = fs.Mesh(data=-1)
    root_path = Path(root)
    state, psi = _state(layers, d_model, vocab, 3, mesh)
    times: dict[str, list[float]] = {"fspeed": [], "dcp": [], "raw": [], "async_stall": [], "async_total": []}
    fspeed_bytes = 0
    mine_size = 0

    def fspeed_save(r: int) -> None:
        nonlocal fspeed_bytes, mine_size
        out = root_path / f"fs{r}"
        times["fspeed"].append(_barrier_time(mesh, lambda: fs.checkpoint.save_checkpoint(out, state, mesh=mesh)))
        mine = out / f"global_step{state.step}" / f"rank_{mesh.rank:05d}.safetensors"
        mine_size = mine.stat().st_size
        fspeed_bytes = sum(mesh.all_gather_objects(mine_size, "bytes"))

    def async_save(r: int) -> None:
        pending = []
        times["async_stall"].append(_barrier_time(mesh, lambda: pending.append(
            fs.checkpoint.save_checkpoint(root_path / f"async{r}", state, mesh=mesh, blocking=False))))
        pending[0].wait()
        times["async_total"].append(max(mesh.all_gather_objects(pending[0].seconds, "async seconds")))

    def dcp_save(r: int) -> None:
        local = {f"rank{mesh.rank}/{k}": v for k, v in _buffers(state).items()}
        times["dcp"].append(_barrier_time(mesh, lambda: dcp.save(local, checkpoint_id=str(root_path / f"dcp{r}"))))

    def raw_write(r: int) -> None:
        size = mine_size or sum(t.numel() * t.element_size() for t in _buffers(state).values())
        times["raw"].append(_barrier_time(mesh, lambda: _raw_write(root_path / f"raw{r}_{mesh.rank}", size)))

    writers = [fspeed_save, dcp_save, raw_write, async_save]
    for r in range(rounds):
        for writer in writers[r % len(writers):] + writers[:r % len(writers)]:  # each round starts with the next
            writer(r)
        mesh.all_gather_objects(None, "cleanup")
        if mesh.rank == 0:
            for name in (f"fs{r}", f"dcp{r}", f"async{r}"):
                shutil.rmtree(root_path / name)
        (root_path / f"raw{r}_{mesh.rank}").unlink()
        mesh.all_gather_objects(None, "cleaned up")
    del state
    # resharding load: ZeRO-1 saved, ZeRO-3 loaded
    source, _ = _state(layers, d_model, vocab, 1, mesh)
    fs.checkpoint.save_checkpoint(root_path / "zero1", source, mesh=mesh)
    del source
    template, _ = _state(layers, d_model, vocab, 3, mesh)
    shard = sum(t.numel() * t.element_size() for t in _buffers(template).values())
    mesh.all_gather_objects(None, "before load")
    _reset_peak()
    baseline = _status("VmRSS")
    loaded, _ = fs.checkpoint.load_checkpoint(root_path / "zero1", template, mesh=mesh)
    peak_extra = _status("VmHWM") - baseline
    mesh.all_gather_objects(None, "after load")
    del loaded
    return {"psi": psi, "times": times, "bytes": fspeed_bytes, "shard": shard, "peak_extra": peak_extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root, GlooWorld(2, timeout_s=1800) as world:
        results = world.run(measure, root, args.layers, args.d_model, args.vocab, args.rounds)
    r0 = results[0]
    times = r0["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = r0["bytes"] / 1e9
    print(f"\nGPT {r0['psi'] / 1e6:.1f}M parameters, fp32 AdamW state, ZeRO-3 on 2 gloo ranks: {gb:.2f} GB per "
          f"checkpoint (both ranks), {args.rounds} rounds (each starting with the next writer), slowest rank")
    print(f"{'writer':<34}{'median s':>10}{'GB/s':>8}   rounds")
    for name, label in (("fspeed", "fspeed save_checkpoint (layout-free)"), ("dcp", "torch.distributed.checkpoint"),
                        ("raw", "raw sequential write + fsync"), ("async_total", "fspeed blocking=False: written"),
                        ("async_stall", "fspeed blocking=False: stall")):
        print(f"{label:<34}{med[name]:>10.2f}{gb / med[name]:>8.2f}   {', '.join(f'{t:.2f}' for t in times[name])}")
    ratio = max(r["peak_extra"] / r["shard"] for r in results)
    shards = ", ".join(f"{r['shard'] / 2**20:.0f}" for r in results)
    peaks = ", ".join(f"{r['peak_extra'] / 2**20:.0f}" for r in results)
    print(f"\nresharding load (ZeRO-1 checkpoint -> ZeRO-3 state): per rank shard {shards} MiB, peak extra "
          f"resident {peaks} MiB")
    best = {k: min(v) for k, v in times.items()}
    print(f"save_time_vs_dcp={med['fspeed'] / med['dcp']:.3f}")
    print(f"save_time_vs_dcp_fastest_rounds={best['fspeed'] / best['dcp']:.3f}")
    print(f"reshard_load_peak_over_shard={ratio:.3f}")
    print(f"save_bandwidth_fraction={med['raw'] / med['fspeed']:.3f}")
    print(f"async_save_stall_over_blocking_save={med['async_stall'] / med['fspeed']:.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/checkpoint_io.json

    with recorded("checkpoint_io"):
        main()
