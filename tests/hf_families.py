"""Hugging Face causal LMs of every family that ships a tensor-parallel plan, built tiny from their
configs with random weights (no download), and the one-step comparison of a plan's gradients with
the module's own eager forward and backward.

`tiny_causal_lm(model_type)` shrinks a family's default config (width 64, 2 layers, 4 heads,
vocabulary 128) and builds its `AutoModelForCausalLM`. `sliced_gradients` runs in every rank of a
gloo world: the module through `fs.functionalize(..., tp_plan="auto")` under `zero(stage) |
tensor_slicing`, one SGD step of lr 1 on one batch, so each parameter moved by exactly its gradient.
`eager_gradients` is the reference: the module's own loss and `backward()`.
"""

from __future__ import annotations

from typing import Optional

import torch

from tests.hf_models import quiet_transformers

VOCAB, SEQ, ROWS = 128, 16, 4

# config attributes set where a family's config has them: small, and consistent across families
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=8, rotary_dim=8,
            partial_rotary_factor=0.5, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16,
            q_lora_rank=16, n_shared_experts=1, first_k_dense_replace=1, num_shared_experts=1, topk_group=1,
            n_group=1)
# randomness the one-process reference cannot share with a plan's run: off
NO_NOISE = ("attention_dropout", "hidden_dropout", "residual_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
            "dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "ffn_dropout", "router_jitter_noise",
            "input_jitter_noise", "activation_dropout", "mlp_dropout")

# families whose default configs are multimodal wrappers or too large to build tiny this way
SKIP = frozenset({"llama4", "phi4_multimodal"})


def tp_plan_families() -> list[str]:
    """Every model type whose config declares a tensor-parallel plan (`base_model_tp_plan`)."""
    quiet_transformers()
    from transformers import CONFIG_MAPPING

    out = []
    for name in sorted(CONFIG_MAPPING.keys()):
        try:
            config_class = CONFIG_MAPPING[name]
        except Exception:  # noqa: BLE001 - a family whose optional dependency is missing
            continue
        if getattr(config_class, "base_model_tp_plan", None) and name not in SKIP:
            out.append(name)
    return out


def tiny_causal_lm(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The family's causal LM at tiny size, random weights from `seed`."""
    quiet_transformers()
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    for key, value in [*TINY.items(), *((key, 0.0) for key in NO_NOISE)]:
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a derived attribute the config computes itself
                pass
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()


def lm_batch(seed: int, rows: int = ROWS) -> dict:
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def lm_loss(outputs, batch):
    return outputs.loss


def eager_gradients(model_type: str, seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """The module's own loss and gradients on `lm_batch(seed)` (the reference)."""
    module = tiny_causal_lm(model_type, seed).train()
    loss = lm_loss(module(**lm_batch(seed)), None)
    loss.backward()
    return float(loss.detach()), {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                         for n, p in module.named_parameters()}


def sliced_gradients(model_type: str, tensor: int, seed: int = 0, stage: int = 0,
                     tp_plan: Optional[dict] = None) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    """One rank's side: the loss, every parameter's gradient (whole) under `zero(stage) |
    tensor_slicing` on `tensor` model ranks (module docstring), and the paths of the parameters
    that the plan sliced. Data ranks split the batch."""
    import fspeed as fs

    module = tiny_causal_lm(model_type, seed)
    model = fs.functionalize(module, lm_loss, tp_plan=tp_plan or "auto")
    mesh = fs.Mesh(data=-1, model=tensor)
    plan = fs.zero(stage, param_persistence_threshold=0) | fs.tensor_slicing(fs.models.module_tp_rules)
    opt = fs.optim.sgd(1.0)
    before = model.init()
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    sliced = [path for path, info in state.layout.info.items() if info.tp_sharded]
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    data, rank = mesh.size("data"), mesh.coordinate("data")
    batch = {k: v.chunk(data)[rank] for k, v in lm_batch(seed).items()}
    state, metrics = step(state, batch)
    after = fs.gather_params(state, mesh)
    moved = {path: b - a for path, b, a in zip(fs.tree_paths(before), fs.pytree.tree_leaves(before),
                                               fs.pytree.tree_leaves(after))}
    return metrics["loss"], moved, sliced


__all__ = ["eager_gradients", "lm_batch", "sliced_gradients", "tiny_causal_lm", "tp_plan_families"]
