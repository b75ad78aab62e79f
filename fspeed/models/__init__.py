"""Models as pure functions of parameter pytrees."""

from .gpt import GPT_RULES, GPTConfig, gpt, gpt_logical_axes, pad_vocab
from .model import LogicalAxes, Model, count_params
from .module import functionalize, to_module
from .ops import DENSE, DenseOps

gpt_rules = GPT_RULES  # the name used in plans: fs.tensor_slicing(fs.models.gpt_rules)

__all__ = [
    "DENSE", "DenseOps", "GPT_RULES", "GPTConfig", "LogicalAxes", "Model", "count_params", "functionalize",
    "gpt", "gpt_logical_axes", "gpt_rules", "pad_vocab", "to_module",
]
