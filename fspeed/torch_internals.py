"""Every private torch API fspeed relies on, in one place, each behind a small named helper.

- functorch's tensor wrappers (`torch._C._functorch`): collectives and kernels run on the plain
  tensor under `torch.func`'s wrappers;
- `torch._C._DisableFuncTorch`: a plain memory copy into storage a recorded graph holds (ZeRO-3
  refills a freed gathered layer for its backward without a version bump);
- `torch._foreach_norm`: the L2 norms of many gradient views in one call;
- `FlopCounterMode.mod_tracker`: the flops profiler gives torch's flop counter its own scopes
  (parameter paths) in place of the nn.Module tracker;
- functorch's interpreter stack and forward-mode AD's level: which `torch.func` transforms are
  active (`decomposed_ops_needed`);
- `aten::_scaled_dot_product_attention_math`: attention's decomposition into differentiable ops.

A torch upgrade that moves one of these breaks here, not across the code base.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._C._functorch import (TransformType, get_interpreter_stack, get_unwrapped, is_functorch_wrapped_tensor,
                                 peek_interpreter_stack)
from torch.autograd import forward_ad


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers.

    Collectives move data and are never differentiated through (fspeed's autograd Functions
    define their own backward), so they always run on the unwrapped tensor.
    """
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor (one fused call)."""
    return list(torch._foreach_norm(tensors))


def apply_function(fn: type, *args: Any) -> Any:
    """`fn.apply(*args)` for an autograd Function with `setup_context` whose forward takes positional
    arguments without defaults. Outside torch.func's transforms this skips `Function.apply`'s
    per-call `inspect.signature` binding (tens of microseconds; a step applies one per unit)."""
    if func_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*torch._functorch.utils.unwrap_dead_wrappers(args))


@contextlib.contextmanager
def below_functorch() -> Iterator[None]:
    """Run tensor code below torch.func's transforms, without autograd (plain memory operations)."""
    with torch._C._DisableFuncTorch(), torch.no_grad():
        yield


def func_transforms_active() -> bool:
    """Whether any `torch.func` transform (grad, vjp, jvp, vmap, ...) is active."""
    return torch._C._are_functorch_transforms_active()


def decomposed_ops_needed(*, vmap: bool = False) -> bool:
    """Whether the transforms now active need ops decomposed into differentiable primitives: fused
    kernels and fspeed's own autograd Functions have no forward-mode rule (`torch.func.jvp`,
    `jacfwd`, `hessian`, `torch.autograd.forward_ad`) and no double backward (a `grad` inside a
    `grad`); with `vmap`, a `vmap` counts too (for an op without a batching rule). Costs about
    0.15 us with no transform or one, 3 us under nested ones."""
    if forward_ad._current_level >= 0:  # functorch's jvp enters a dual level too
        return True
    top = peek_interpreter_stack()
    if top is None:
        return False
    if top.level() == 1:  # one transform (levels count from 1 at the outermost)
        return vmap and top.key() == TransformType.Vmap
    grads = 0
    for interpreter in get_interpreter_stack():
        kind = interpreter.key()
        if kind == TransformType.Jvp or (vmap and kind == TransformType.Vmap):
            return True
        grads += kind == TransformType.Grad
    return grads > 1


def sdpa_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: Any = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` by its math backend (softmax(q k^T * scale + mask) v in
    differentiable ops, the same numbers as `sdpa_kernel(SDPBackend.MATH)`), without touching the
    process-wide backend switches that `sdpa_kernel` sets."""
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def _as_given(formula):
    """A registered flop formula (it already takes tensors) marked so FlopCounterMode does not wrap it again."""
    def given(*args, **kwargs):
        return formula(*args, **kwargs)

    given._get_raw = True
    return given


def flop_counter_with_scopes(tracker) -> "torch.utils.flop_counter.FlopCounterMode":
    """torch's FlopCounterMode attributing each op's flops to `tracker.parents` (a set of scope
    names, "Global" among them) instead of the nn.Modules it tracks itself."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    cpu_attention = {  # CPU's fused attention counts as the CUDA kernels do (torch's registry lacks it)
        getattr(aten, name): _as_given(flop_counter.flop_registry[cuda_op]) for name, cuda_op in (
            ("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
            ("_scaled_dot_product_flash_attention_for_cpu_backward", aten._scaled_dot_product_flash_attention_backward))
        if hasattr(aten, name) and cuda_op in flop_counter.flop_registry}
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_attention)
    if not hasattr(counter, "mod_tracker"):
        raise RuntimeError(f"torch {torch.__version__}: FlopCounterMode has no mod_tracker; the flops profiler "
                           "needs torch 2.4-2.13's layout")
    counter.mod_tracker = tracker
    return counter


__all__ = ["AsyncCollectiveTensor", "below_functorch", "decomposed_ops_needed", "flop_counter_with_scopes",
           "foreach_norm", "func_transforms_active", "funcol_all_gather", "funcol_all_reduce", "funcol_reduce_scatter",
           "sdpa_math", "unwrapped"]
