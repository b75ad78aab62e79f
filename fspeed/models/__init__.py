"""Models as pure functions of parameter pytrees."""

from .gpt import GPTConfig, gpt, gpt_logical_axes
from .model import LogicalAxes, Model, count_params, functionalize

__all__ = ["GPTConfig", "LogicalAxes", "Model", "count_params", "functionalize", "gpt", "gpt_logical_axes"]
