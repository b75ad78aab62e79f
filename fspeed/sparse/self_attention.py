"""Module-free sparse self-attention: DeepSpeed's SparseSelfAttention, BertSparseSelfAttention and
SparseAttentionUtils' padding helpers, as plain functions and a frozen description.

`SparseSelfAttention(config, max_seq_length)` builds the master layout once for
`max_seq_length` and, for a shorter sequence, uses its top-left `[:L/block, :L/block]` corner, as
DeepSpeed does (so a layout for L is *not* `layout(config, L)` when random or fixed-window blocks
depend on the length). Called on q, k, v of any length, it pads the sequence to a multiple of the
block (masking the pad keys), attends, and cuts the padding off again. Masks keep DeepSpeed's
defaults: `key_padding_mask_mode="add"`, `attn_mask_mode="mul"`. Unlike DeepSpeed it takes
fp32/bf16/fp16 (DeepSpeed asserts fp16) and needs no process group: the seeded layout is the
same on every rank, so there is nothing to broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .attention import additive_mask, attention, check_backend
from .config import AnySparsityConfig, SparseAttentionConfig
from .layouts import layout
from .plan import BlockPlan, make_plan


@dataclass(frozen=True)
class SparseSelfAttention:
    """What DeepSpeed's `SparseSelfAttention` module holds, minus the module: call it on q, k, v.

    `causal=True` adds token-level causal masking (for decoders; DeepSpeed leaves that to a
    unidirectional layout plus an attn_mask).
    """

    sparsity_config: AnySparsityConfig
    max_seq_length: int = 2048
    key_padding_mask_mode: str = "add"
    attn_mask_mode: str = "mul"
    causal: bool = False
    seed: int = 0
    backend: str = "auto"
    master_layout: torch.Tensor = field(init=False, repr=False, compare=False)
    _plans: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.sparsity_config, SparseAttentionConfig):
            raise ValueError("SparseSelfAttention needs a layout family; use "
                             "SparseAttentionConfig.to_sparsity_config(num_heads)")
        block = self.sparsity_config.block
        if self.max_seq_length < block or self.max_seq_length % block:
            raise ValueError(f"max_seq_length={self.max_seq_length} must be a positive multiple of block={block}")
        for name in ("key_padding_mask_mode", "attn_mask_mode"):
            if getattr(self, name) not in ("add", "mul"):
                raise ValueError(f"{name}={getattr(self, name)!r} must be 'add' or 'mul'")
        check_backend(self.backend)
        object.__setattr__(self, "master_layout", layout(self.sparsity_config, self.max_seq_length, seed=self.seed))
        object.__setattr__(self, "_plans", {})  # per padded length: an index cache, not state that changes results

    @property
    def block(self) -> int:
        return self.sparsity_config.block

    def plan_for(self, seq_len: int) -> BlockPlan:
        """The plan of the master layout's corner covering `seq_len` (a multiple of the block)."""
        if seq_len % self.block or seq_len > self.max_seq_length:
            raise ValueError(f"seq_len={seq_len} must be a multiple of block={self.block} and at most "
                             f"max_seq_length={self.max_seq_length}")
        if seq_len not in self._plans:
            nb = seq_len // self.block
            self._plans[seq_len] = make_plan(self.master_layout[:, :nb, :nb], self.block, causal=self.causal)
        return self._plans[seq_len]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 key_padding_mask: Optional[torch.Tensor] = None,
                 attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention over [batch, heads, seq, head_dim] inputs of any seq <= max_seq_length.

        key_padding_mask: [batch, seq]; attn_mask: [seq, seq]; modes as configured.
        """
        B, H, L, D = query.shape
        if H != self.sparsity_config.num_heads:
            raise ValueError(f"query has {H} heads but the sparsity config has "
                             f"num_heads={self.sparsity_config.num_heads}")
        if L > self.max_seq_length:
            raise ValueError(f"sequence length {L} exceeds max_seq_length={self.max_seq_length}")
        pad = (-L) % self.block
        kb = None
        if key_padding_mask is not None:
            kb = additive_mask(key_padding_mask, torch.float32, self.key_padding_mask_mode, name="key_padding_mask")
        am = None
        if attn_mask is not None:
            am = additive_mask(attn_mask, torch.float32, self.attn_mask_mode, name="attn_mask")
        if pad:
            query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
            kb = torch.zeros(B, L, device=query.device) if kb is None else kb.expand(B, L)
            kb = F.pad(kb, (0, pad), value=float("-inf"))  # pad keys are never attended
            if am is not None:
                am = F.pad(am, (0, pad, 0, pad))
        out = attention(query, key, value, self.plan_for(L + pad), causal=self.causal, key_padding_mask=kb,
                        attn_mask=am, backend=self.backend)
        return out[:, :, :L] if pad else out


def bert_sparse_self_attention(params: dict, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                               attn: SparseSelfAttention) -> torch.Tensor:
    """DeepSpeed's `BertSparseSelfAttention` as a function of its parameters.

    params: {"query"|"key"|"value": {"weight": [hidden, hidden], "bias": [hidden]}} (HF BERT's
    names); hidden_states [batch, seq, hidden]; attention_mask [batch, seq] used as the key
    padding mask in `attn`'s mode. Returns the context layer [batch, seq, hidden].
    """
    B, L, hidden = hidden_states.shape
    H = attn.sparsity_config.num_heads
    if hidden % H:
        raise ValueError(f"hidden size {hidden} is not a multiple of num_heads={H}")

    def heads(name: str) -> torch.Tensor:
        x = F.linear(hidden_states, params[name]["weight"], params[name]["bias"])
        return x.view(B, L, H, hidden // H).transpose(1, 2)

    context = attn(heads("query"), heads("key"), heads("value"), key_padding_mask=attention_mask)
    return context.transpose(1, 2).reshape(B, L, hidden)


def pad_to_block_size(block_size: int, input_ids: Optional[torch.Tensor] = None,
                      attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                      position_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                      pad_token_id: int = 0, embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """DeepSpeed's `SparseAttentionUtils.pad_to_block_size`: pad the sequence dim to a multiple of the block.

    Returns (pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds).
    input_ids pad with `pad_token_id`, attention_mask and token_type_ids with 0, position_ids with
    `pad_token_id` (DeepSpeed's choice), and inputs_embeds with `embed(pad ids)` (DeepSpeed calls the
    model's embeddings; pass `embed`, or zeros are used).
    """
    source = input_ids if input_ids is not None else inputs_embeds
    if source is None:
        raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
    B, L = source.shape[:2]
    pad_len = (block_size - L % block_size) % block_size
    if pad_len == 0:
        return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
    if input_ids is not None:
        input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
    if inputs_embeds is not None:
        pad_ids = torch.full((B, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
        if embed is not None:
            pad_embeds = embed(pad_ids)
        else:
            pad_embeds = inputs_embeds.new_zeros(B, pad_len, inputs_embeds.shape[-1])
        inputs_embeds = torch.cat([inputs_embeds, pad_embeds], dim=-2)
    if position_ids is not None:
        position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
    if attention_mask is not None:
        attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
    if token_type_ids is not None:
        token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
    return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's `SparseAttentionUtils.unpad_sequence_output`: drop the last `pad_len` positions."""
    return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
