"""Prove that your own model trains under a parallel plan exactly as it does on one process.

    python examples/prove_my_model.py
    python examples/prove_my_model.py --show-a-failure      # also a model that tensor slicing breaks, caught

`fspeed.testing.assert_trains_like_one_process` trains the model under a plan on a few gloo ranks (CPU
processes: no GPU needed) and on one process, on the same global batches, and compares the first
step's gradients, an SGD trajectory, the optimizer's trajectory and the losses. A failure names which
of them differed, the parameter, the step and by how much. Here the model is a small transformer
written as a plain `nn.Module`; a Hugging Face model works the same way (`tp_plan="auto"` takes its
own tensor-parallel plan). Put it in your test suite as it is here.

The ranks start by re-importing this script, so `build_model`, `make_batch` and `loss_fn` are
top-level functions and the checks run under `if __name__ == "__main__":`.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import fspeed as fs
from fspeed.testing import GlooWorld, assert_trains_like_one_process

VOCAB, SEQ, WIDTH, HEADS = 64, 16, 32, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor slicing a rank holds a slice of q, k and v, so fewer heads
        q, k, v = (f(x).view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden_norm: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.hidden_norm = hidden_norm

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = F.gelu(self.up(self.norm2(x)))
        if self.hidden_norm:  # an RMS norm over the MLP's hidden features: under tensor slicing a rank
            h = F.rms_norm(h, h.shape[-1:])  # holds half of them, so it normalizes by the wrong mean
        return x + self.down(h)


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2, hidden_norm: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(hidden_norm) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# Megatron-style slicing of each block, written in Hugging Face's tp_plan styles (patterns of module paths)
TP_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
           "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every process builds the same initial weights
    return TinyLM()


def build_model_with_hidden_norm() -> nn.Module:
    """A model that trains on one process and runs under TP_PLAN, but computes something else there."""
    torch.manual_seed(0)
    return TinyLM(hidden_norm=True)


def make_batch(rows: int, seed: int):
    """(inputs, targets): random tokens and the same tokens shifted by one."""
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps of each trajectory")
    parser.add_argument("--show-a-failure", action="store_true", help="also check a model that slicing breaks")
    args = parser.parse_args()

    checks = [  # (what, plan, options)
        ("ZeRO-2 on 2 data ranks", fs.zero(2), {}),
        ("ZeRO-3 on 2 data ranks, 2 accumulation steps", fs.zero(3), {"grad_accum": 2}),
        ("tensor slicing on 2 ranks", fs.zero(0) | fs.tensor_slicing(fs.models.module_tp_rules),
         {"tensor": 2, "tp_plan": TP_PLAN}),
        ("ZeRO-1 + tensor slicing in bf16", fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules),
         {"tensor": 2, "tp_plan": TP_PLAN, "precision": "bf16", "rtol": 2e-2, "atol": 1e-3}),
    ]
    with GlooWorld(2) as world:  # one pair of processes serves every check
        for what, plan, options in checks:
            assert_trains_like_one_process(build_model, plan, make_batch=make_batch, loss_fn=loss_fn, world=world,
                                           world_size=2, steps=args.steps, **options)
            print(f"ok: {what} trains like one process ({plan!r})")
        if args.show_a_failure:
            try:
                assert_trains_like_one_process(build_model_with_hidden_norm,
                                               fs.zero(0) | fs.tensor_slicing(fs.models.module_tp_rules),
                                               make_batch=make_batch, loss_fn=loss_fn, world=world, world_size=2,
                                               tensor=2, tp_plan=TP_PLAN, steps=args.steps)
            except AssertionError as err:  # names what differed: the parameter, the step, by how much
                print(f"caught, as it should be: the model with a norm over the sliced MLP features\n{err}")
            else:
                raise SystemExit("the model that slicing breaks was not caught")


if __name__ == "__main__":
    main()
