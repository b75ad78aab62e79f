"""The benchmark page, generated from `benchmarks/results/*.json`.

Each benchmark writes one file (`benchmarks/figures.py`): {"benchmark", "date", "commit", "machine",
"command", "figures": {name: value}, and optionally "notes": {name: text}}. Every file found is
rendered as one section; the page says so when there is none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ("benchmark", "date", "commit", "machine", "command", "figures")


class ResultError(ValueError):
    """A results file that does not have the documented format."""


def load(path: Path) -> dict[str, Any]:
    """One results file, checked: every field present, figures a mapping of names to numbers."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ResultError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ResultError(f"{path}: expected a JSON object")
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise ResultError(f"{path}: missing {', '.join(missing)} (fields: {', '.join(FIELDS)})")
    if not isinstance(data["figures"], dict):
        raise ResultError(f"{path}: figures must be an object of name -> number")
    if not isinstance(data.get("notes", {}), dict):
        raise ResultError(f"{path}: notes must be an object of figure name -> text")
    return data


def results(directory: Path = RESULTS) -> list[dict[str, Any]]:
    """Every results file in `directory`, sorted by benchmark name."""
    return sorted((load(p) for p in sorted(directory.glob("*.json"))), key=lambda d: str(d["benchmark"]))


def figure_text(value: Any) -> str:
    """A figure as shown: up to 4 significant digits; null (nan or inf) as n/a; text as written."""
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(directory: Path = RESULTS) -> str:
    """The benchmark page as Markdown."""
    out = ["# Benchmarks", "",
           "Measured comparisons against the real alternatives, side by side in one run (ratios rather than "
           "absolute times where the machine matters). Each benchmark in `benchmarks/` writes "
           "`benchmarks/results/<benchmark>.json`; this page is generated from those files, with the date, "
           "commit, machine and command of each measurement.", ""]
    found = results(directory) if directory.is_dir() else []
    if not found:
        out += ["No benchmark results are recorded yet: running a benchmark (`python benchmarks/<name>.py`) writes "
                "`benchmarks/results/<name>.json`, and the page shows it at the next build.", ""]
        return "\n".join(out)
    out += ["| benchmark | date | commit | machine |", "|---|---|---|---|"]
    for data in found:
        name = _cell(data["benchmark"])
        out.append(f"| [{name}](#{anchor(name)}) | {_cell(data['date'])} | `{str(data['commit'])[:10]}` | "
                   f"{_cell(data['machine'])} |")
    for data in found:
        name = _cell(data["benchmark"])
        out += ["", f"## {name} {{#{anchor(name)}}}", "",
                f"{_cell(data['date'])}, commit `{str(data['commit'])[:10]}`, {_cell(data['machine'])}.", "",
                "```text", str(data["command"]), "```", "",
                "| figure | value | note |", "|---|---|---|"]
        notes = data.get("notes", {})
        out += [f"| `{_cell(k)}` | {_cell(figure_text(v))} | {_cell(notes.get(k, ''))} |"
                for k, v in data["figures"].items()]
    out.append("")
    return "\n".join(out)


def anchor(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


# ------------------------------------------------------------------------------ the README's headline

HEADLINES = (  # (benchmark, figure, what it compares); lower is better for times and bytes
    ("train_step_overhead", "overhead_ratio", "fspeed's step / a hand-written PyTorch loop (time)"),
    ("your_model", "hf_step_time_vs_eager", "a Hugging Face GPT-2 step / an eager loop"),
    ("your_model", "hf_zero3_step_time_vs_fsdp2", "GPT-2, ZeRO-3 / FSDP2 on 2 ranks"),
    ("your_model", "hf_zero1_step_time_vs_ddp", "GPT-2, ZeRO-1 / DDP on 2 ranks"),
    ("vs_deepspeed", "zero_step_time_vs_deepspeed", "ZeRO 0-3 / DeepSpeed's (the worst stage)"),
    ("zero_memory", "zero3_bytes_per_rank_over_formula", "ZeRO-3 model-state bytes per rank / the ZeRO paper"),
    ("zero_comm", "zero3_comm_over_theory", "ZeRO-3 elements moved per step / theory"),
    ("tensor_parallel", "tensor_parallel_step_time_vs_torch", "TP2 Llama / PyTorch's parallelize_module"),
    ("pipeline", "pipeline_step_time_vs_torch", "1F1B on 2 stages / torch.distributed.pipelining"),
    ("pipeline", "zero_bubble_over_1f1b", "zero-bubble schedule / 1F1B (time)"),
    ("activation_memory", "full_remat_saved_bytes_over_theory", "bytes kept with full remat / theory"),
    ("activation_memory", "remat_vs_torch_checkpoint_step_time", "remat / torch.utils.checkpoint (time)"),
    ("checkpoint_io", "save_time_vs_dcp", "sharded save / torch.distributed.checkpoint"),
    ("goodput", "goodput_under_faults", "useful step time / wall time, 3 rank kills healed by restarts"),
    ("autotune", "autotune_best_over_grid_best", "the autotuned layout's throughput / the best of a 40-layout "
                 "grid (higher is better)"),
    ("cpu_adam", "cpu_adam_vs_best", "CPU Adam / the best of torch and DeepSpeed"),
    ("sparse_attention", "sparse_speedup_at_10pct_density", "block-sparse speed-up over dense at 10% density"),
)
README_START = "<!-- benchmark headline: generated by `python docs/hooks/benchmark_tables.py --readme` -->"
README_END = "<!-- end of benchmark headline -->"


def readme_table(directory: Path = RESULTS) -> str:
    """The README's headline table: the `HEADLINES` figures that the results files hold."""
    found = {d["benchmark"]: d for d in results(directory)} if directory.is_dir() else {}
    rows = [(name, figure, what, found[name]) for name, figure, what in HEADLINES
            if name in found and figure in found[name]["figures"]]
    if not rows:
        return "No benchmark results are recorded yet (`benchmarks/results/`)."
    out = ["| benchmark | figure | value | measured |", "|---|---|---|---|"]
    for name, figure, what, data in rows:
        out.append(f"| `{name}.py`: {what} | `{figure}` | {figure_text(data['figures'][figure])} | "
                   f"{_cell(data['date'])}, `{str(data['commit'])[:10]}` |")
    return "\n".join(out)


def readme_block(directory: Path = RESULTS) -> str:
    return f"{README_START}\n{readme_table(directory)}\n{README_END}"


def update_readme(readme: Path = ROOT / "README.md", directory: Path = RESULTS) -> bool:
    """Rewrite the README's headline block from the results files; True if it changed."""
    text = readme.read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    new = text[:start] + readme_block(directory) + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--readme"]:
        sys.exit("usage: python docs/hooks/benchmark_tables.py --readme   (rewrites README.md's headline table)")
    print("README.md updated" if update_readme() else "README.md is up to date")
