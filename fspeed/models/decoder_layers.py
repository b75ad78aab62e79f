"""`decoder_layers(hf_causal_lm)`: a Hugging Face decoder-only model of the Llama family (Llama,
Mistral, Qwen2) as a layer list, with its own tensor-parallel plan.

    model = fs.models.decoder_layers(llama)                   # batches: {"input_ids": ..., "labels": ...}
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules) | fs.pipeline(8, "1f1b")
    mesh = fs.Mesh(data=-1, model=2, pipe=2)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    fs.models.decoder_layers_to_module(fs.gather_params(state, mesh), llama)   # trained weights back in

The layers are the token embedding, each decoder layer (its rotary tables from the model's rotary
embedding, causal attention over every position), the final norm and the output head, built with
`sequential`; a model that ties its embedding and head keeps them as one `TiedLayer`. The model's
tp_plan (`tp_plan_from`: its blocks' projections colwise/rowwise, the head colwise) is mapped onto
the layers' paths, and the embedding is sliced over the vocabulary; a tied embedding only when the
head is fused with the loss (`causal_lm_loss`), which then computes the vocabulary-parallel loss.

`traced_layers` pipelines any module without this; these layers also tensor-slice, which an
exported graph (its head counts baked into its reshapes) cannot. Built only for the model types in
`MODEL_TYPES`, and only when the layers' logits equal the module's own on a probe batch (anything
else is refused, named); a layer with a sliding attention window (Mistral's) refuses sequences
longer than it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .causal_lm import causal_lm_loss
from .module_sequence import TiedLayer, head_of, sequential
from ..pytree import PyTree, tree_leaves, tree_paths
from .model import Model
from .module import nested, to_module
from .module_tp import tp_plan_from

PROBE_POSITIONS = 8
# Hugging Face model types whose causal LM's forward is the embedding, the decoder layers (rotary
# positions, causal attention: a sliding window where configured), the final norm and the head, no
# more: no scaled embedding or soft-capped logits (Gemma's), no per-head norms that a tensor slice
# would need reduced (Qwen3's)
MODEL_TYPES = ("llama", "mistral", "qwen2")


class DecoderBlock(nn.Module):
    """One decoder layer as a layer of hidden states: positions 0..S-1, the model's rotary tables,
    causal attention (left to the attention's own causal path where it has one)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, implicit_causal: bool, window: Optional[int] = None):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.implicit_causal = implicit_causal
        self.window = window  # the layer's sliding attention window, if it has one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.window is not None and x.shape[1] > self.window:
            raise ValueError(f"decoder_layers: this layer attends over a sliding window of {self.window} positions, "
                             f"fewer than the sequence's {x.shape[1]}, and decoder_layers computes full causal "
                             "attention; use fs.models.traced_layers(module, example) for longer sequences")
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mask = None
        if not self.implicit_causal:  # an additive mask: eager attention adds it to the scores
            mask = torch.full((x.shape[1], x.shape[1]), torch.finfo(x.dtype).min, dtype=x.dtype,
                              device=x.device).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out


def decoder_layers(module: nn.Module, *, loss_fn: Callable[[Any, Any], torch.Tensor] = causal_lm_loss,
                   name: Optional[str] = None, fused_ops: bool = True) -> Model:
    """The layers of `module` (module docstring), a `Model` whose layer list the pipeline cuts and
    whose tp_plan `fs.tensor_slicing(fs.models.module_tp_rules)` slices. `loss_fn(logits, batch)`:
    `causal_lm_loss` by default (the head fused with it, on batches with "input_ids" and "labels").
    `fused_ops`: `sequential`'s (Python tanh-GELUs as torch's fused kernel; False: the module's own ops)."""
    kind = type(module).__name__
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"decoder_layers: {kind} (model_type {model_type!r}) is not one of {list(MODEL_TYPES)}, "
                         "whose forward is exactly embedding, decoder layers, norm and head; use "
                         "fs.models.traced_layers(module, example) or list its layers with fs.models.sequential")
    body = getattr(module, getattr(module, "base_model_prefix", "model"), None)
    parts = {part: getattr(body, part, None) for part in ("embed_tokens", "layers", "norm", "rotary_emb")}
    head = getattr(module, "lm_head", None)
    missing = [part for part, value in parts.items() if value is None] + ([] if isinstance(head, nn.Linear) else
                                                                          ["lm_head (an nn.Linear)"])
    if missing:
        raise ValueError(f"decoder_layers: {kind} has no {missing} where a Llama-family causal LM has them (model."
                         "embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head); use "
                         "fs.models.traced_layers(module, example) or list its layers with fs.models.sequential")
    attention = getattr(module.config, "_attn_implementation", None) or "eager"
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"decoder_layers: {kind} computes attention with {attention!r}; allowed: 'eager', 'sdpa' "
                         "(set module.config._attn_implementation)")
    implicit = attention == "sdpa"
    blocks = [DecoderBlock(layer, parts["rotary_emb"], implicit, _window(module.config, i))
              for i, layer in enumerate(parts["layers"])]
    fused = getattr(loss_fn, "fuses_head", False)
    tied = head.weight is parts["embed_tokens"].weight
    plan = {f"*.layer.{path.split('.', 3)[3]}": style for path, style in tp_plan_from(module).items()
            if path.startswith(f"{module.base_model_prefix}.layers.*.")}
    if tied:
        embed = parts["embed_tokens"]
        entries = [TiedLayer("embed", embed), *blocks, parts["norm"],
                   TiedLayer("embed", embed, forward=head_of("weight") if fused else _logits)]
        if fused:
            plan["tied.embed"] = "embedding_rowwise"
    else:
        entries = [parts["embed_tokens"], *blocks, parts["norm"], head]
        plan["0"] = "embedding_rowwise"
        plan[str(len(entries) - 1)] = "colwise" if fused else "colwise_gather_output"
    _check_against(module, parts["embed_tokens"], blocks, parts["norm"], head)
    return sequential(entries, loss_fn=loss_fn, inputs=lambda batch: batch["input_ids"],
                      name=name or f"{kind}-layers", tp_plan=plan, fused_ops=fused_ops)


def _window(config: Any, i: int) -> Optional[int]:
    """Layer i's sliding attention window (Mistral's `sliding_window`, a "sliding_attention" layer type)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    return window if types is None or types[i] == "sliding_attention" else None


def _logits(embed: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.weight.t()


def _check_against(module: nn.Module, embed: nn.Module, blocks: list, norm: nn.Module, head: nn.Linear) -> None:
    """The layers' logits equal the module's own on a probe batch, or a ValueError says they do not."""
    ids = torch.randint(0, module.config.vocab_size, (1, PROBE_POSITIONS), generator=torch.Generator().manual_seed(0))
    ids = ids.to(head.weight.device)
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            want = module(input_ids=ids).logits
            x = embed(ids)
            for block in blocks:
                x = block(x)
            got = head(norm(x))
    finally:
        module.train(training)
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4):
        raise ValueError(f"decoder_layers: {type(module).__name__}'s own forward does more than its embedding, "
                         "decoder layers, norm and head (a scaled embedding, a sliding-window mask, ...): the "
                         "layers' logits differ from the module's on a probe batch. Use "
                         "fs.models.traced_layers(module, example) or list its layers with fs.models.sequential")


def decoder_layers_to_module(params: PyTree, module: nn.Module) -> nn.Module:
    """Copy `decoder_layers(module)`'s trained parameters (a full tree: `fs.gather_params(state,
    mesh)`) into `module` under its own names (`fs.to_module`): layer 0 is `model.embed_tokens`,
    layer i+1 `model.layers.i`, then `model.norm` and `lm_head` (a tied head: the embedding)."""
    prefix = getattr(module, "base_model_prefix", "model")
    blocks = len(getattr(getattr(module, prefix), "layers"))
    renamed = {}
    for path, tensor in zip(tree_paths(params), tree_leaves(params)):
        head, _, rest = path.partition(".")
        if head == "tied":  # tied.embed.<name>: the embedding, which is also the head
            name = f"{prefix}.embed_tokens.{rest.partition('.')[2]}"
        elif head == "0":
            name = f"{prefix}.embed_tokens.{rest}"
        elif int(head) <= blocks:
            name = f"{prefix}.layers.{int(head) - 1}.{rest.removeprefix('layer.')}"
        else:
            name = f"{prefix}.norm.{rest}" if int(head) == blocks + 1 else f"lm_head.{rest}"
        renamed[name] = tensor
    return to_module(nested(renamed), module)


def sliceable_layers(module: nn.Module, loss_fn: Optional[Callable] = None, *, fused_ops: bool = True) -> Model:
    """What `fs.initialize` and fspeed-train pipeline a module as when they also tensor-slice it:
    `decoder_layers(module)`, its loss `causal_lm_loss` of the head's logits (a causal LM's own);
    a `loss_fn` of the module's outputs does not fit them and is refused, as other modules are."""
    if loss_fn is not None and loss_fn is not causal_lm_loss:
        raise ValueError("a pipeline that also tensor-slices runs a module as fs.models.decoder_layers(module), whose "
                         "loss takes the head's logits: leave loss_fn out (fs.causal_lm_loss) or pass "
                         "fs.models.decoder_layers(module, loss_fn=...) as the model")
    if getattr(getattr(module, "config", None), "model_type", None) not in MODEL_TYPES:
        raise ValueError(f"a pipeline that also tensor-slices needs a module's layers with their tp_plan, which "
                         f"fs.models.decoder_layers builds for Hugging Face model types {list(MODEL_TYPES)}; "
                         f"{type(module).__name__} is not one: pass fs.models.sequential([...], loss_fn=..., "
                         "tp_plan=...) as the model, or set parallel.tensor=1")
    return decoder_layers(module, fused_ops=fused_ops)
