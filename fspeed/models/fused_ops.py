"""Torch's fused kernels in place of Python compositions in third-party modules.

Hugging Face's `gelu_new` activation (GPT-2, GPT-J, GPT-Neo, CodeGen, Phi...), its `gelu_fast` and
`gelu_accurate`, and BLOOM's `BloomGelu` compute the tanh approximation of GELU in Python: eight
elementwise kernels forward and more backward, most of them keeping their output for backward.
`F.gelu(x, approximate="tanh")` is the same formula in one kernel each way: Hugging Face's own
`gelu_pytorch_tanh`, which its documentation calls equivalent and much faster, not bit-equal (the
two agree to about one ulp).

A `functionalize`d module's (and a `sequential` layer list's) instances of those classes compute
through it, and `traced_layers` traces them as it, unless `fused_ops=False`; the module itself is
not changed (an instance forward is set for the call only, as for tensor slicing). Forward and
backward of a 6-layer, 384-wide GPT-2 take about 9% less time on one CPU core, and the forward keeps
0.65x the bytes for backward (`benchmarks/your_model.py`); on a GPU each removed kernel is a launch.
The idea is Liger-Kernel's and Hugging Face's kernel hub's: a faster kernel chosen by class.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# (module, class) of the Python tanh-approximated GELUs: the same function as F.gelu(approximate="tanh")
GELU_TANH_CLASSES = frozenset({
    ("transformers.activations", "NewGELUActivation"),
    ("transformers.activations", "FastGELUActivation"),
    ("transformers.activations", "AccurateGELUActivation"),
    ("transformers.models.bloom.modeling_bloom", "BloomGelu"),
})


def gelu_tanh(input: torch.Tensor) -> torch.Tensor:
    return F.gelu(input, approximate="tanh")


def fused_forward(module: nn.Module) -> Optional[Callable[..., torch.Tensor]]:
    """The fused computation of `module`, or None: by its exact class (a subclass may compute
    otherwise) while that class's forward is its own, and not where a forward is set on the instance
    (a hook's wrapper, a hub kernel) or on the class (a patch)."""
    cls = type(module)
    if (cls.__module__, cls.__name__) not in GELU_TANH_CLASSES or "forward" in module.__dict__:
        return None
    forward = cls.__dict__.get("forward")
    if getattr(forward, "__qualname__", "") != f"{cls.__name__}.forward" or \
            getattr(forward, "__module__", "") != cls.__module__:
        return None
    return gelu_tanh


def fused_forwards(module: Optional[nn.Module]) -> dict[nn.Module, Callable[..., torch.Tensor]]:
    """`module` and its submodules that compute fused, with how."""
    if module is None:
        return {}
    return {m: f for m in module.modules() if (f := fused_forward(m)) is not None}


__all__ = ["GELU_TANH_CLASSES", "fused_forward", "fused_forwards", "gelu_tanh"]
