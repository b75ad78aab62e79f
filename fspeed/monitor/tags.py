"""What the event monitors (TensorBoard, W&B) log: metric columns as tags, at the global step.

Tags follow DeepSpeed's leaf names (`train_loss`, `eval_loss`, `lr`, `loss_scale`,
`elapsed_time_ms_forward`, ...) under `Train/`; the x-axis is the optimizer step (DeepSpeed uses
samples seen; `Train/samples` is logged too, so either axis can be plotted). The comm log's summary
goes under `Comm/<op>/`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

TAGS = {
    "loss": "Train/train_loss",
    "val_loss": "Train/eval_loss",
    "lr": "Train/lr",
    "loss_scale": "Train/loss_scale",
    "grad_norm": "Train/grad_norm",
    "skipped": "Train/skipped",
    "samples": "Train/samples",
    "tokens_per_s": "Train/tokens_per_s",
    "samples_per_s": "Train/samples_per_s",
    "tflops": "Train/tflops",
    "mfu": "Train/mfu",
    "fwd_ms": "Train/elapsed_time_ms_forward",
    "bwd_ms": "Train/elapsed_time_ms_backward",
    "bwd_inner_ms": "Train/elapsed_time_ms_backward_inner",
    "bwd_allreduce_ms": "Train/elapsed_time_ms_backward_allreduce",
    "step_ms": "Train/elapsed_time_ms_step",
    "allgather_ms": "Train/elapsed_time_ms_allgather",
    "curriculum_seqlen": "Train/curriculum_seqlen",
    "curriculum_difficulty": "Train/curriculum_difficulty",
    "pld_theta": "Train/pld_theta",
    "remat_forward_ms": "Train/remat/forward_ms",
    "remat_recompute_ms": "Train/remat/recompute_ms",
    "remat_backward_ms": "Train/remat/backward_ms",
}
"""Metric column -> tag; columns not here (step, elapsed_s) are not logged as scalars."""


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's loggable values by tag (None and absent values are left out)."""
    return {TAGS[k]: float(v) for k, v in row.items() if k in TAGS and v is not None}


def comm_scalars(log: Any) -> dict[str, float]:
    """The comm log's totals per op (`fspeed.CommLog`): bytes, calls and latency."""
    out: dict[str, float] = {}
    for op, nbytes in log.bytes_by_op.items():
        out[f"Comm/{op}/bytes"] = float(nbytes)
    for op, by_size in log.records.items():
        latencies = [t for times in by_size.values() for t in times]
        out[f"Comm/{op}/count"] = float(len(latencies))
        out[f"Comm/{op}/latency_ms"] = 1e3 * sum(latencies)
    return out


class MissingExtraError(ImportError):
    """A monitor's optional package is not installed; names the extra that installs it."""

    def __init__(self, what: str, package: str, key: Optional[str] = None):
        self.key = key
        super().__init__(f"{what} needs the {package!r} package, which is not installed: "
                         "pip install 'fspeed[monitor]'")
