"""Block-sparse attention: DeepSpeed's layouts, a differentiable block-sparse op, module-free self-attention.

    import fspeed as fs
    lay = fs.sparse.layout(fs.sparse.FixedConfig(num_heads=8, block=16, num_local_blocks=4), seq_len=4096)
    out = fs.sparse.attention(q, k, v, lay, causal=True, key_padding_mask=mask)
    print(fs.sparse.format_layout(lay))
"""

from .attention import BACKENDS, BlockSparseAttention, additive_mask, attention, reference_attention
from .config import (
    ATTENTION_TYPES,
    MODES,
    BigBirdConfig,
    BSLongformerConfig,
    DenseConfig,
    FixedConfig,
    LocalSlidingWindowConfig,
    SparseAttentionConfig,
    SparsityConfig,
    VariableConfig,
)
from .layouts import density, expand_layout, layout, num_blocks
from .plan import BlockPlan, make_plan
from .self_attention import SparseSelfAttention, bert_sparse_self_attention, pad_to_block_size, unpad_sequence_output
from .show import format_layout, layout_image, save_layout_png, write_png

__all__ = [
    "ATTENTION_TYPES", "BACKENDS", "MODES", "BigBirdConfig", "BlockPlan", "BlockSparseAttention",
    "BSLongformerConfig", "DenseConfig", "FixedConfig", "LocalSlidingWindowConfig", "SparseAttentionConfig",
    "SparsityConfig", "VariableConfig", "additive_mask", "attention", "density", "expand_layout",
    "format_layout", "layout", "layout_image", "make_plan", "num_blocks", "reference_attention",
    "save_layout_png", "write_png", "SparseSelfAttention", "bert_sparse_self_attention", "pad_to_block_size",
    "unpad_sequence_output",
]
