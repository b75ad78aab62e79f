"""Every Hugging Face family that ships a tensor-parallel plan, sliced by it on 2 gloo ranks against
its own eager forward and backward.

For each model type whose config declares `base_model_tp_plan`: build its causal LM at tiny size
from the config (random weights, no download; `tests/hf_families.py`), run one step of
`fs.functionalize(module, loss, tp_plan="auto")` under `zero(0) | tensor_slicing` on 2 tensor ranks,
and compare the loss and every parameter's gradient with the module's own `backward()`. A family
ends in one of:

    equal          loss and gradients equal to rounding (largest difference over the largest gradient)
    equal (fixed)  the first step named whole parameters whose gradients were partial (its plan lacks
                   replicated_with_grad_allreduce for them); with the named entries added, equal
    refused        fspeed refuses the plan with a message (a style it does not slice, a pattern naming
                   a parameter, a head count the slices cannot divide)
    not built      the family's default config does not shrink to this tiny size (its message)
    DIFFERS        a wrong result: what this sweep exists to catch (must be 0)

    python benchmarks/tp_families.py [--only gemma,qwen3]

Last lines: tp_families_with_plan, tp_families_built, tp_families_equal, tp_families_equal_fixed,
tp_families_refused, tp_families_differing.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOLERANCE = 1e-4  # largest gradient difference over the largest gradient


def compare(world, model_type: str) -> tuple[str, str]:
    import fspeed as fs
    from tests.hf_families import eager_gradients, sliced_gradients, tiny_causal_lm

    try:
        want_loss, want = eager_gradients(model_type)
    except Exception as err:  # noqa: BLE001 - a family that does not build tiny is reported, not fatal
        return "not built", _first_line(err)
    plan, fixed = None, False
    for _ in range(2):
        try:
            loss, got, sliced = world.run(sliced_gradients, model_type, 2, tp_plan=plan)[0]
            break
        except fs.testing.WorkerError as err:
            partial = re.findall(r"'([^']+)': 'replicated_with_grad_allreduce'", str(err))
            if partial and plan is None:
                plan = {**fs.tp_plan_from(tiny_causal_lm(model_type)),
                        **{m: "replicated_with_grad_allreduce" for m in partial}}
                fixed = True
                continue
            return "refused", _worker_message(err)
    peak = max(float(g.abs().max()) for g in want.values())
    worst = max(float((got[path] - g).abs().max()) for path, g in want.items())
    relative = worst / peak
    loss_ok = abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    if not sliced:
        return "refused", "the plan sliced nothing"
    status = ("equal (fixed)" if fixed else "equal") if relative <= TOLERANCE and loss_ok else "DIFFERS"
    detail = f"{len(sliced)} sliced, grad diff {relative:.1e}, loss {loss:.6f} vs {want_loss:.6f}"
    if fixed:
        detail += f"; added {sorted(k for k, v in plan.items() if v == 'replicated_with_grad_allreduce')}"
    return status, detail


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:140] if str(err).strip() else ''}"


def _worker_message(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if re.match(r"^\w*(Error|Exception): ", line)]
    return (lines[0] if lines else _first_line(err))[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one with a plan)")
    args = parser.parse_args()
    from fspeed.testing import GlooWorld
    from tests.hf_families import tp_plan_families

    families = args.only.split(",") if args.only else tp_plan_families()
    rows = []
    start = time.perf_counter()
    with GlooWorld(2, timeout_s=300) as world:
        for i, model_type in enumerate(families, 1):
            status, detail = compare(world, model_type)
            rows.append((model_type, status, detail))
            print(f"[{i}/{len(families)}] {model_type:<24} {status:<14} {detail}", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'family':<{width}}  {'status':<14} detail")
    for model_type, status, detail in rows:
        print(f"{model_type:<{width}}  {status:<14} {detail}")
    count = lambda *names: sum(r[1] in names for r in rows)  # noqa: E731
    print(f"\n{len(rows)} families in {time.perf_counter() - start:.0f} s")
    print(f"tp_families_with_plan={len(rows)}")
    print(f"tp_families_built={len(rows) - count('not built')}")
    print(f"tp_families_equal={count('equal')}")
    print(f"tp_families_equal_fixed={count('equal (fixed)')}")
    print(f"tp_families_refused={count('refused')}")
    print(f"tp_families_differing={count('DIFFERS')}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/tp_families.json

    with recorded("tp_families"):
        main()
