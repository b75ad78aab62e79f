"""The reference GPT, written as pure functions of a parameter dict (nanoGPT's model, functional).

Pre-LayerNorm blocks, causal self-attention through `scaled_dot_product_attention` (decomposed
under `jvp`, `hessian` and nested `grad`: `fspeed.models.attention`), a GELU MLP,
learned positions, optional tied input/output embeddings. Dropout (embeddings and residual
branches) draws from an explicit `torch.Generator`, so a step is a pure function of
(params, batch, generator seed). Attention-probability dropout is not offered: SDPA's dropout uses
the global RNG, which would make steps irreproducible.

With `attention="sparse"` every layer's attention is fspeed's block-sparse attention
(`fspeed.sparse`) over the layout of `sparse_attention` (DeepSpeed's `sparse_attention` block),
built once for `seq_len` (rounded up to the block) and causal; parameters are unchanged.

Parameter paths and logical axes:

    wte [vocab, embed]          wpe [seq, embed]           head [vocab, embed] (untied only)
    blocks.i.ln1.{weight,bias} [embed]                     ln_f.{weight,bias} [embed]
    blocks.i.attn.wqkv [qkv, heads, embed]   bqkv [qkv, heads]   wo [embed, heads]   bo [embed]
    blocks.i.mlp.w_in [mlp, embed]   b_in [mlp]   w_out [embed, mlp]   b_out [embed]

Weights are stored [out, in] as in `nn.Linear`, so their gradients come out contiguous and the
flat gradient buffer is assembled by plain copies. "heads" is the flattened (head, head_dim) dim:
sharding it in contiguous chunks splits whole heads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from ..sparse import SparseAttentionConfig, SparseSelfAttention
from .attention import scaled_dot_product_attention
from .layer_drop import PLD_BATCH_KEY, LayerDrop, kept_blocks
from .layers import Layer, LayerSequence
from .model import LogicalAxes, Model
from .ops import DENSE, DenseOps
from ..rng import layer_generators

ATTENTIONS = ("dense", "sparse")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: Optional[int] = None  # default 4 * d_model
    dropout: float = 0.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    attention: str = "dense"  # "dense" (SDPA) or "sparse" (block-sparse, layout from sparse_attention)
    sparse_attention: Optional[SparseAttentionConfig] = None  # None with attention="sparse": the JSON defaults
    fused_head: Optional[bool] = None  # the head and loss as one op (head_loss); None: by size (FUSED_HEAD_MIN_LOGITS)

    def __post_init__(self):
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{key}={value!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff={self.d_ff} must be positive (or None for 4*d_model)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if self.init_std <= 0:
            raise ValueError(f"GPTConfig.init_std={self.init_std} must be > 0")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"GPTConfig.attention={self.attention!r} must be one of {ATTENTIONS}")
        if self.sparse_attention is not None and not isinstance(self.sparse_attention, SparseAttentionConfig):
            raise ValueError("GPTConfig.sparse_attention must be a fspeed.sparse.SparseAttentionConfig, got "
                             f"{type(self.sparse_attention).__name__}")

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return scaled_dot_product_attention(q, k, v, is_causal=True)


def _attend(cfg: GPTConfig):
    """Causal attention over [B, heads, S, head_dim]: SDPA, or block-sparse with the configured layout.

    Under tensor slicing a rank holds fewer heads; a layout shared by all heads then serves any
    head count, a per-head layout cannot (the rank's head offset is not known here).
    """
    if cfg.attention == "dense":
        return _dense_attention
    sparse = cfg.sparse_attention or SparseAttentionConfig()
    length = -(-cfg.seq_len // sparse.block) * sparse.block
    by_heads = {cfg.n_head: SparseSelfAttention(sparse.to_sparsity_config(cfg.n_head), max_seq_length=length,
                                                causal=True, seed=sparse.seed)}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads = q.shape[1]
        if heads not in by_heads:
            if sparse.different_layout_per_head:
                raise ValueError(f"sparse attention with different_layout_per_head=True needs all {cfg.n_head} heads "
                                 f"on one rank, got {heads} (tensor slicing): use a layout shared by all heads")
            by_heads[heads] = SparseSelfAttention(sparse.to_sparsity_config(heads), max_seq_length=length,
                                                  causal=True, seed=sparse.seed)
        return by_heads[heads](q, k, v)

    return attend


def gpt(cfg: GPTConfig) -> Model:
    """The reference GPT as a `Model`. Batches are dicts with `inputs` and `targets`, both [B, S] long."""
    attend = _attend(cfg)

    def init(generator: torch.Generator) -> dict:
        D, F_, V = cfg.d_model, cfg.hidden, cfg.vocab_size

        def normal(*shape, std=cfg.init_std):
            return torch.randn(*shape, generator=generator) * std

        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections

        def layer_norm():
            return {"weight": torch.ones(D), "bias": torch.zeros(D)}

        params = {
            "wte": normal(V, D),
            "wpe": normal(cfg.seq_len, D),
            "blocks": [
                {
                    "ln1": layer_norm(),
                    "attn": {
                        "wqkv": normal(3, D, D),
                        "bqkv": torch.zeros(3, D),
                        "wo": normal(D, D, std=residual_std),
                        "bo": torch.zeros(D),
                    },
                    "ln2": layer_norm(),
                    "mlp": {
                        "w_in": normal(F_, D),
                        "b_in": torch.zeros(F_),
                        "w_out": normal(D, F_, std=residual_std),
                        "b_out": torch.zeros(D),
                    },
                }
                for _ in range(cfg.n_layer)
            ],
            "ln_f": layer_norm(),
        }
        if not cfg.tie_embeddings:
            params["head"] = normal(V, D)
        return params

    def trunk(params: dict, inputs: torch.Tensor, rng: Optional[torch.Generator], ops: DenseOps,
              layer_drop: Optional[LayerDrop]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block's output and the head's weight."""
        B, S = inputs.shape
        if S > cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={cfg.seq_len}")
        wte = ops.param(params["wte"])
        x = ops.embedding(inputs, wte, vocab_axis="vocab") + ops.param(params["wpe"])[:S]
        # layer i of `gpt_layers` (embed, blocks, head) draws from generator i, as on a pipeline stage
        rngs = layer_generators(rng if cfg.dropout else None, cfg.n_layer + 1)
        x = _dropout(x, cfg.dropout, rngs[0])
        block = functools.partial(_block, n_head=cfg.n_head, dropout=cfg.dropout, ops=ops, attend=attend)
        scales = kept_blocks(layer_drop, cfg.n_layer, training=rng is not None)
        tail = params["ln_f"] if cfg.tie_embeddings else params["head"]  # what runs after the blocks
        if all(scale == 1.0 for scale in scales):
            x = ops.scan(block, params["blocks"], x, rngs[1:], after=tail)
        else:  # progressive layer dropping: dropped blocks are not run; kept ones rescale their branches
            kept = [j for j, scale in enumerate(scales) if scale is not None]
            for j, nxt in zip(kept, kept[1:] + [None]):  # each names its successor (ZeRO-3 prefetches it)
                x = ops.scan(functools.partial(block, scale=scales[j]), [params["blocks"][j]], x, rngs[1 + j],
                             first=j, after=params["blocks"][nxt] if nxt is not None else tail)
        return x, wte if cfg.tie_embeddings else ops.param(params["head"])

    def apply(params: dict, inputs: torch.Tensor, *, rng: Optional[torch.Generator] = None,
              ops: DenseOps = DENSE, layer_drop: Optional[LayerDrop] = None) -> torch.Tensor:
        """Logits [B, S, vocab] for token ids `inputs` [B, S] (vocab-local under tensor slicing);
        `layer_drop`: the step's progressive layer dropping (`layer_drop` module), in training only."""
        x, head = trunk(params, inputs, rng, ops, layer_drop)
        return _head_logits(x, ops.param(params["ln_f"]), head, ops)

    def loss(params: dict, batch: dict, *, rng: Optional[torch.Generator] = None,
             ops: DenseOps = DENSE) -> torch.Tensor:
        """Mean next-token cross-entropy, computed in fp32 (fp64 for a fp64 model). A batch's
        `layer_drop` (a `LayerDrop`: the step's progressive layer dropping) drops blocks. ln_f, the
        head and the loss are one op from a size up (`_head_and_loss`, `GPTConfig.fused_head`)."""
        x, head = trunk(params, batch["inputs"], rng, ops, batch.get(PLD_BATCH_KEY))
        return _head_and_loss(x, ops.param(params["ln_f"]), head, batch["targets"], ops, cfg.fused_head)

    return Model(init, apply, loss, gpt_logical_axes(cfg), name="gpt", layers=gpt_layers(cfg, attend))


def gpt_layers(cfg: GPTConfig, attend=None) -> LayerSequence:
    """The GPT as layers for a pipeline: `embed` (wte, wpe), `blocks.0` .. `blocks.{n-1}`, `head` (ln_f and
    the tied wte, or `head`); the loss is the cross-entropy of the head's logits, and `last_with_loss`
    the head and loss as `gpt(cfg).loss` fuses them. The same ops in the same order as `gpt(cfg).loss`
    (progressive layer dropping is not offered here)."""
    attend = attend or _attend(cfg)

    def embed(params: dict, inputs: torch.Tensor, *, rng=None, ops: DenseOps = DENSE) -> torch.Tensor:
        S = inputs.shape[1]
        if S > cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={cfg.seq_len}")
        x = ops.embedding(inputs, ops.param(params["wte"]), vocab_axis="vocab") + ops.param(params["wpe"])[:S]
        return _dropout(x, cfg.dropout, rng)

    def block(i: int):
        def run(params: dict, x: torch.Tensor, *, rng=None, ops: DenseOps = DENSE) -> torch.Tensor:
            fn = functools.partial(_block, n_head=cfg.n_head, dropout=cfg.dropout, ops=ops, attend=attend)
            return ops.scan(fn, [params["blocks"][i]], x, rng, first=i)
        return run

    def head(params: dict, x: torch.Tensor, *, rng=None, ops: DenseOps = DENSE) -> torch.Tensor:
        w = ops.param(params["wte" if cfg.tie_embeddings else "head"])
        return _head_logits(x, ops.param(params["ln_f"]), w, ops)

    def loss(logits: torch.Tensor, batch: dict, *, ops: DenseOps = DENSE) -> torch.Tensor:
        return ops.cross_entropy(logits, batch["targets"], vocab_axis="vocab")

    def head_with_loss(params: dict, x: torch.Tensor, batch: dict, *, ops: DenseOps = DENSE) -> torch.Tensor:
        w = ops.param(params["wte"] if cfg.tie_embeddings else params["head"])
        return _head_and_loss(x, ops.param(params["ln_f"]), w, batch["targets"], ops, cfg.fused_head)

    layers = [Layer("embed", embed, ("wte", "wpe"), "Embedding", True)]
    layers += [Layer(f"blocks.{i}", block(i), (f"blocks.{i}",), "TransformerBlock", True) for i in range(cfg.n_layer)]
    layers.append(Layer("head", head, ("ln_f", "wte" if cfg.tie_embeddings else "head"), "Head", True))
    return LayerSequence(tuple(layers), lambda batch: batch["inputs"], loss, head_with_loss)


def pad_vocab(vocab_size: int, multiple: int = 8) -> int:
    """`vocab_size` rounded up to a multiple (Megatron pads the vocabulary so tensor slicing divides
    it evenly and the embedding GEMMs stay aligned; the extra ids are never produced by the tokenizer)."""
    return -(-vocab_size // multiple) * multiple


GPT_RULES = (("heads", "model"), ("mlp", "model"), ("vocab", "model"))
"""Megatron's tensor slicing of the GPT: attention heads, the MLP hidden dim and the vocabulary."""


def gpt_logical_axes(cfg: GPTConfig) -> LogicalAxes:
    axes: LogicalAxes = {"wte": ("vocab", "embed"), "wpe": (None, "embed")}
    for i in range(cfg.n_layer):
        p = f"blocks.{i}"
        axes.update({
            f"{p}.ln1.weight": ("embed",), f"{p}.ln1.bias": ("embed",),
            f"{p}.attn.wqkv": (None, "heads", "embed"), f"{p}.attn.bqkv": (None, "heads"),
            f"{p}.attn.wo": ("embed", "heads"), f"{p}.attn.bo": ("embed",),
            f"{p}.ln2.weight": ("embed",), f"{p}.ln2.bias": ("embed",),
            f"{p}.mlp.w_in": ("mlp", "embed"), f"{p}.mlp.b_in": ("mlp",),
            f"{p}.mlp.w_out": ("embed", "mlp"), f"{p}.mlp.b_out": ("embed",),
        })
    axes.update({"ln_f.weight": ("embed",), "ln_f.bias": ("embed",)})
    if not cfg.tie_embeddings:
        axes["head"] = ("vocab", "embed")
    return axes


def _layer_norm(x: torch.Tensor, p: dict) -> torch.Tensor:
    return _layer_norm_of(x, p["weight"], p["bias"])


def _layer_norm_of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def _head_logits(x: torch.Tensor, ln_f: dict, head: torch.Tensor, ops: DenseOps) -> torch.Tensor:
    """ln_f then the output head: the logits (vocab-local under tensor slicing)."""
    return ops.linear(_layer_norm(x, ln_f), head, out_axis="vocab", in_axis="embed")


FUSED_HEAD_MIN_LOGITS = 1 << 20
"""Logits elements of a micro-batch (positions x the rank's vocabulary) from which the GPT's head and
loss are one op (`GPTConfig.fused_head=None`). Below, the separate ops are faster and what the fused
op saves (the logits kept for backward) is a few MB: its fixed cost is about 0.5 ms of small ops
(1024 positions x 256 words, width 256, forward + backward on one CPU thread: 4.1 against 3.4 ms;
equal at 1024 words, 0.96x at 4096, 0.77x at 16384)."""


def _head_and_loss(x: torch.Tensor, ln_f: dict, head: torch.Tensor, targets: torch.Tensor,
                   ops: DenseOps, fused: Optional[bool] = None) -> torch.Tensor:
    """ln_f, the head and the mean cross-entropy as one op (`ops.head_loss`: its gradient taken in
    forward, no logits kept for backward) where `fused` says so (None: from FUSED_HEAD_MIN_LOGITS
    logits up); in fp16 as separate ops under the loss scale, because a gradient taken at scale 1
    would underflow there."""
    if fused is None:
        fused = x.shape[:-1].numel() * head.shape[0] >= FUSED_HEAD_MIN_LOGITS
    if x.dtype == torch.float16 or not fused:
        return ops.cross_entropy(_head_logits(x, ln_f, head, ops), targets, vocab_axis="vocab")
    return ops.head_loss(x, head, targets, norm=_layer_norm_of, norm_params=(ln_f["weight"], ln_f["bias"]),
                         vocab_axis="vocab", in_axis="embed")


def _block(p: dict, x: torch.Tensor, rng: Optional[torch.Generator], *, n_head: int, dropout: float,
           ops: DenseOps, attend=_dense_attention, scale: float = 1.0) -> torch.Tensor:
    """One pre-LN block: x + attn(ln1(x)), then + mlp(ln2(x)), each branch times `scale` (1 / keep
    probability under layer dropping). Heads and the MLP hidden dim are the logical axes tensor
    slicing shards (column-parallel in, row-parallel out)."""
    attn, mlp = p["attn"], p["mlp"]
    qkv = ops.linear(_layer_norm(x, p["ln1"]), attn["wqkv"], attn["bqkv"], out_axis="heads", in_axis="embed")
    # chunks, not one rearrange of (three h d): backward then joins the three gradients with one cat,
    # where unbinding a permuted view would stack them and copy again (the same q, k, v views either way)
    q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=ops.local(n_head, "heads")) for t in qkv.chunk(3, dim=-1))
    y = rearrange(attend(q, k, v), "b h s d -> b s (h d)")
    branch = _dropout(ops.linear(y, attn["wo"], attn["bo"], out_axis="embed", in_axis="heads"), dropout, rng)
    x = x + (branch if scale == 1.0 else branch * scale)
    h = F.gelu(ops.linear(_layer_norm(x, p["ln2"]), mlp["w_in"], mlp["b_in"], out_axis="mlp", in_axis="embed"))
    branch = _dropout(ops.linear(h, mlp["w_out"], mlp["b_out"], out_axis="embed", in_axis="mlp"), dropout, rng)
    return x + (branch if scale == 1.0 else branch * scale)


def _dropout(x: torch.Tensor, p: float, rng: Optional[torch.Generator]) -> torch.Tensor:
    if rng is None or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=rng, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
