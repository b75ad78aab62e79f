"""Models as pure functions of parameter pytrees."""

from .causal_lm import causal_lm_loss
from .decoder_layers import decoder_layers, decoder_layers_to_module
from .gpt import GPT_RULES, GPTConfig, gpt, gpt_logical_axes, pad_vocab
from .layers import Layer, LayerSequence
from .layer_drop import LayerDrop, kept_blocks, step_layer_drop
from .model import LogicalAxes, Model, count_params
from .module import functionalize, to_module
from .module_sequence import TiedLayer, head_of, sequential
from .module_tp import MODULE_TP_RULES, tp_plan_from
from .ops import DENSE, DenseOps
from .traced import traced_layers

gpt_rules = GPT_RULES  # the name used in plans: fs.tensor_slicing(fs.models.gpt_rules)
module_tp_rules = MODULE_TP_RULES  # a functionalized module's tp_plan: fs.tensor_slicing(fs.models.module_tp_rules)

__all__ = [
    "DENSE", "DenseOps", "GPT_RULES", "GPTConfig", "LogicalAxes", "Model", "causal_lm_loss", "count_params",
    "decoder_layers", "decoder_layers_to_module",
    "functionalize",
    "MODULE_TP_RULES", "gpt", "gpt_logical_axes", "gpt_rules", "module_tp_rules", "pad_vocab", "to_module",
    "tp_plan_from", "LayerDrop", "kept_blocks", "step_layer_drop",
    "Layer", "LayerSequence", "TiedLayer", "head_of", "sequential", "traced_layers",
]
