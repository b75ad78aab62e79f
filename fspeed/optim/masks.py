"""Weight-decay masks, Optax's `mask=`: a predicate over parameter paths saying which get weight decay.

    opt = adamw(3e-4, weight_decay=0.1, mask=no_decay("bias", "norm"))

A mask is any `path -> bool` (True: decay). `no_decay(*names)` is the usual one. Its rule: a
parameter gets no weight decay when one of its path's dot-separated parts contains one of `names`,
ignoring case. "bias" exempts `h.0.attn.c_attn.bias` and `ln1.bias`; "norm" exempts
`model.norm.weight`, `layers.0.input_layernorm.weight` and `LayerNorm.weight`; "ln" exempts
`ln_1.weight` and `ln_f.bias`; "bn" exempts `bn1.weight`. Without names it uses
`DEFAULT_NO_DECAY`. Choose names that occur only where meant ("bn" also matches a part named
`subnet`); a bias or norm not named so needs its own name: the reference GPT's biases are
`bqkv`, `bo`, `b_in`, `b_out` (`no_decay("ln", "bqkv", "bo", "b_in", "b_out")`), a ResNet's
downsample norm is `downsample.1`. Padding pieces of a ZeRO partition (paths ending in ".pad")
never get weight decay.

Paths, not shapes, decide: under ZeRO an optimizer sees 1-D pieces of its rank's parameters, so
"every 1-D tensor" cannot be told apart from a piece of a matrix there.
"""

from __future__ import annotations

from typing import Callable

from .base import GradientTransformation
from .groups import hyperparameter_names, is_padding, param_groups

Mask = Callable[[str], bool]
DEFAULT_NO_DECAY = ("bias", "norm", "ln", "bn")


class no_decay:  # noqa: N801 - used as a function: no_decay("bias", "norm")
    """A mask (path -> bool, True: decay) exempting paths with a part containing one of `names`
    (module docstring for the rule)."""

    def __init__(self, *names: str):
        names = names or DEFAULT_NO_DECAY
        for name in names:
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"no_decay: {name!r} must be a non-empty name without dots (matched within "
                                 "each dot-separated part of a parameter path)")
        self.names = tuple(n.lower() for n in names)

    def __call__(self, path: str) -> bool:
        if is_padding(path):
            return False
        return not any(name in part for part in path.lower().split(".") for name in self.names)

    def __repr__(self) -> str:
        return f"no_decay({', '.join(map(repr, self.names))})"


class _Exempt:
    """The paths a weight-decay mask leaves out (the group that gets weight_decay=0)."""

    def __init__(self, mask: Mask):
        self.mask = mask

    def __call__(self, path: str) -> bool:
        decay = self.mask(path)
        if not isinstance(decay, bool):
            raise TypeError(f"weight-decay mask {self.mask!r} returned {decay!r} for {path!r}; it must return a bool")
        return not decay

    def __repr__(self) -> str:
        return f"not {self.mask!r}"


def masked_weight_decay(optimizer: GradientTransformation, mask: Mask) -> GradientTransformation:
    """`optimizer` with its weight decay only on the parameters `mask` selects (others get 0)."""
    if not callable(mask):
        raise TypeError(f"mask must be a predicate over parameter paths (e.g. no_decay('bias', 'norm')), "
                        f"got {type(mask).__name__}")
    if "weight_decay" not in hyperparameter_names(optimizer):
        raise ValueError(f"mask= selects the parameters that get weight decay, but {optimizer!r} has no weight_decay")
    hparams = optimizer.info.hparams
    if not hparams.get("weight_decay"):
        raise ValueError(f"mask= selects the parameters that get weight decay, but {optimizer.info.name} has "
                         "weight_decay=0; set weight_decay > 0 or drop the mask")
    return param_groups(optimizer, [{"name": "no_decay", "params": _Exempt(mask), "weight_decay": 0.0}])


__all__ = ["DEFAULT_NO_DECAY", "Mask", "masked_weight_decay", "no_decay"]
