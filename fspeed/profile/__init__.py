"""Profiling: the flops profiler (DeepSpeed's `flops_profiler`) and model TFLOPS / MFU.

    prof = fs.profile.flops(model, params, batch)
    print(prof.table(depth=2, top=5))
    print(fs.profile.report(prof, step=5))
"""

from .flops import FlopsProfile, ModuleProfile, flops
from .report import aggregated, detailed, report
from .throughput import measure_peak_tflops, step_tflops

__all__ = ["FlopsProfile", "ModuleProfile", "aggregated", "detailed", "flops", "measure_peak_tflops", "report",
           "step_tflops"]
