"""A flops profile (what `fspeed.profile.flops` measures) and its printout in DeepSpeed's layout:
header and summary, the aggregated profile (top modules per depth by params, MACs and forward
latency) and the detailed module tree.

Throughput follows DeepSpeed's formulas: backward = (2 + recompute_fwd_factor) x forward flops,
forward+backward = (3 + recompute_fwd_factor) x forward flops, over the measured latencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModuleProfile:
    """One module path's totals in the profiled forward."""

    path: str
    params: int
    flops: int
    latency_s: float
    calls: int

    @property
    def macs(self) -> int:
        return self.flops // 2

    @property
    def depth(self) -> int:
        return self.path.count(".") + 1


class FlopsProfile:
    """The result of `flops(...)`: totals and `modules` (path -> `ModuleProfile`), with DeepSpeed's
    printouts (`table`, `detailed`; `fspeed.profile.report` for the whole report)."""

    def __init__(self, modules: dict[str, ModuleProfile], total_flops: int, total_params: int, latency_s: float,
                 batch_rows: int):
        self.modules, self.total_flops, self.total_params = modules, total_flops, total_params
        self.latency_s, self.batch_rows = latency_s, batch_rows

    @property
    def total_macs(self) -> int:
        return self.total_flops // 2

    def __enter__(self) -> "FlopsProfile":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def table(self, depth: int = -1, top: int = 1) -> str:
        return aggregated(self, depth, top)

    def detailed(self, depth: int = -1) -> str:
        return detailed(self, depth)


_RULE = "-" * 90


def _title(text: str) -> str:
    return f" {text} ".center(90, "-")

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def si(value: float, unit: str = "", places: int = 2) -> str:
    """`value` with an SI prefix: si(2.5e9, "FLOPS") == "2.5 GFLOPS"."""
    for scale, prefix in _UNITS:
        if abs(value) >= scale:
            return f"{round(value / scale, places):g} {prefix}{unit}"
    return f"{round(value, places):g} {unit}".rstrip()


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _by_depth(profile: FlopsProfile, depth: int) -> list[ModuleProfile]:
    return [m for m in profile.modules.values() if m.depth == depth]


def aggregated(profile: FlopsProfile, module_depth: int = -1, top_modules: int = 1, name: str = "model") -> str:
    """DeepSpeed's "Aggregated Profile per GPU": per depth (0 = the whole model, up to
    `module_depth`; -1 = all), the `top_modules` modules by params, MACs and forward latency."""
    deepest = max((m.depth for m in profile.modules.values()), default=0)
    last = deepest if module_depth < 0 else min(module_depth, deepest)
    lines = [_title("Aggregated Profile per GPU"),
             f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        if depth == 0:
            mods = [ModuleProfile(name, profile.total_params, profile.total_flops, profile.latency_s, 1)]
        else:
            mods = _by_depth(profile, depth)
        lines.append(f"depth {depth}:")
        for label, key, show in (("params", lambda m: m.params, lambda m: si(m.params)),
                                 ("MACs", lambda m: m.macs, lambda m: si(m.macs, "MACs")),
                                 ("fwd latency", lambda m: m.latency_s, lambda m: duration(m.latency_s))):
            top = sorted(mods, key=key, reverse=True)[:top_modules]
            lines.append(f"    {label:<11} - {{{', '.join(repr(m.path) + ': ' + repr(show(m)) for m in top)}}}")
    return "\n".join(lines)


def detailed(profile: FlopsProfile, module_depth: int = -1, name: str = "model") -> str:
    """DeepSpeed's "Detailed Profile per GPU": the module tree, each module followed by its params,
    MACs and forward latency (with their shares of the total) and its achieved FLOPS."""
    lines = [_title("Detailed Profile per GPU"),
             "Each module profile is listed after its name in the following order:",
             "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
             "percentage of total fwd latency, fwd FLOPS"]
    root = ModuleProfile(name, profile.total_params, profile.total_flops, profile.latency_s, 1)
    for m in [root, *profile.modules.values()]:
        depth = 0 if m is root else m.depth
        if module_depth >= 0 and depth > module_depth:
            continue
        flops_rate = m.flops / m.latency_s if m.latency_s > 0 else 0.0
        lines.append(f"{'  ' * depth}{m.path}({si(m.params)} = {_share(m.params, profile.total_params)} Params, "
                     f"{si(m.macs, 'MACs')} = {_share(m.macs, profile.total_macs)} MACs, {duration(m.latency_s)} = "
                     f"{_share(m.latency_s, profile.latency_s)} latency, {si(flops_rate, 'FLOPS')})")
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.2%}" if whole else "0%"


def report(profile: FlopsProfile, *, step: int, name: str = "model", world_size: int = 1, data_parallel: int = 1,
           model_parallel: int = 1, bwd_latency_s: Optional[float] = None, step_latency_s: Optional[float] = None,
           recompute_fwd_factor: float = 0.0, module_depth: int = -1, top_modules: int = 1,
           detailed_profile: bool = True) -> str:
    """The whole DeepSpeed Flops Profiler printout for `profile` taken at `step`. Backward and
    optimizer-step latencies (from the wall-clock breakdown) add the fwd+bwd and iteration lines."""
    fwd, r = profile.total_flops, recompute_fwd_factor
    lines = [_title("DeepSpeed Flops Profiler"),
             f"Profile Summary at step {step}:",
             "Notations:", "data parallel size (dp_size), model parallel size(mp_size),",
             "number of parameters (params), number of multiply-accumulate operations(MACs),",
             "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
             "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
             "step (weights update latency), iter latency (sum of fwd, bwd and step latency)", "",
             f"{'world size:':<60}{world_size}",
             f"{'data parallel size:':<60}{data_parallel}",
             f"{'model parallel size:':<60}{model_parallel}",
             f"{'batch size per GPU:':<60}{profile.batch_rows}",
             f"{'params per GPU:':<60}{si(profile.total_params)}",
             f"{'params of model = params per GPU * mp_size:':<60}{si(profile.total_params * model_parallel)}",
             f"{'fwd MACs per GPU:':<60}{si(profile.total_macs, 'MACs')}",
             f"{'fwd flops per GPU:':<60}{si(fwd)}",
             f"{'fwd flops of model = fwd flops per GPU * mp_size:':<60}{si(fwd * model_parallel)}",
             f"{'fwd latency:':<60}{duration(profile.latency_s)}",
             f"{'fwd FLOPS per GPU = fwd flops per GPU / fwd latency:':<60}{si(fwd / profile.latency_s, 'FLOPS')}"]
    if bwd_latency_s:
        both = profile.latency_s + bwd_latency_s
        lines += [f"{'bwd latency:':<60}{duration(bwd_latency_s)}",
                  f"{f'bwd FLOPS per GPU = {2 + r:g} * fwd flops per GPU / bwd latency:':<60}"
                  f"{si((2 + r) * fwd / bwd_latency_s, 'FLOPS')}",
                  f"{f'fwd+bwd FLOPS per GPU = {3 + r:g} * fwd flops per GPU / (fwd+bwd latency):':<60}"
                  f"{si((3 + r) * fwd / both, 'FLOPS')}"]
        if step_latency_s is not None:
            it = both + step_latency_s
            lines += [f"{'step latency:':<60}{duration(step_latency_s)}",
                      f"{'iter latency:':<60}{duration(it)}",
                      f"{f'FLOPS per GPU = {3 + r:g} * fwd flops per GPU / iter latency:':<60}"
                      f"{si((3 + r) * fwd / it, 'FLOPS')}",
                      f"{'samples/second:':<60}{profile.batch_rows * world_size / it:.2f}"]
    lines += ["", aggregated(profile, module_depth, top_modules, name)]
    if detailed_profile:
        lines += ["", detailed(profile, module_depth, name)]
    lines.append(_RULE)
    return "\n".join(lines)


__all__ = ["FlopsProfile", "ModuleProfile", "aggregated", "detailed", "duration", "report", "si"]
