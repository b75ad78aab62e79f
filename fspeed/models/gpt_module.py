"""The reference GPT as an ordinary `nn.Module`, with converters to and from fspeed's param tree.

Same math as `fspeed.models.gpt`, written the usual PyTorch way (nn.Linear, nn.LayerNorm), so a
plain PyTorch training loop can be compared with fspeed's `train_step` on identical weights, and
weights can move between the two worlds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..pytree import tree_map
from .attention import scaled_dot_product_attention
from .gpt import GPTConfig
from .head_loss import loss_dtype


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, cfg.hidden), nn.Linear(cfg.hidden, d)
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTModule(nn.Module):
    """nn.Module twin of the functional reference GPT (dropout 0 only)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.dropout:
            raise ValueError("GPTModule mirrors the functional GPT without dropout; use dropout=0")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.wte(inputs) + self.wpe.weight[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t() if self.head is None else self.head(x)

    def loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["inputs"])
        return F.cross_entropy(logits.to(loss_dtype(logits.dtype)).flatten(0, 1), batch["targets"].flatten())


def params_from_module(module: GPTModule) -> dict:
    """fspeed GPT params (detached copies) holding the module's weights."""
    d = module.cfg.d_model

    def ln(m: nn.LayerNorm) -> dict:
        return {"weight": m.weight, "bias": m.bias}

    params = {
        "wte": module.wte.weight,
        "wpe": module.wpe.weight,
        "blocks": [
            {
                "ln1": ln(b.ln1),
                "attn": {"wqkv": b.qkv.weight.view(3, d, d), "bqkv": b.qkv.bias.view(3, d),
                         "wo": b.proj.weight, "bo": b.proj.bias},
                "ln2": ln(b.ln2),
                "mlp": {"w_in": b.fc.weight, "b_in": b.fc.bias, "w_out": b.out.weight, "b_out": b.out.bias},
            }
            for b in module.blocks
        ],
        "ln_f": ln(module.ln_f),
    }
    if module.head is not None:
        params["head"] = module.head.weight
    return tree_map(lambda t: t.detach().clone().contiguous(), params)


def load_params_into_module(module: GPTModule, params: dict) -> None:
    """Copy fspeed GPT params into the module's weights (in place)."""
    d = module.cfg.d_model
    with torch.no_grad():
        module.wte.weight.copy_(params["wte"])
        module.wpe.weight.copy_(params["wpe"])
        for b, p in zip(module.blocks, params["blocks"]):
            for m, key in ((b.ln1, "ln1"), (b.ln2, "ln2")):
                m.weight.copy_(p[key]["weight"])
                m.bias.copy_(p[key]["bias"])
            b.qkv.weight.copy_(p["attn"]["wqkv"].reshape(3 * d, d))
            b.qkv.bias.copy_(p["attn"]["bqkv"].reshape(-1))
            b.proj.weight.copy_(p["attn"]["wo"])
            b.proj.bias.copy_(p["attn"]["bo"])
            b.fc.weight.copy_(p["mlp"]["w_in"])
            b.fc.bias.copy_(p["mlp"]["b_in"])
            b.out.weight.copy_(p["mlp"]["w_out"])
            b.out.bias.copy_(p["mlp"]["b_out"])
        module.ln_f.weight.copy_(params["ln_f"]["weight"])
        module.ln_f.bias.copy_(params["ln_f"]["bias"])
        if module.head is not None:
            module.head.weight.copy_(params["head"])

