"""A model and a dataset of your own, as fspeed-train's `model._target_` and `data._target_` take them.

    fspeed-train model._target_=examples.my_model.build_model model.n_layer=2 \
                 data._target_=examples.my_model.build_dataset train.steps=20

(run from the repository root, or put this file in your own package and name it there). Any
`model.<key>` or `data.<key>` is an argument of the builder, checked against its signature before
anything runs.

    python -m examples.my_model        # proves that it trains under ZeRO-3 on 2 ranks as on one process
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A residual MLP block: the repeated unit that ZeRO-3 gathers and remat recomputes."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Next-token prediction with MLP blocks; `forward(input_ids, labels)` returns the loss."""

    def __init__(self, vocab_size: int = 64, d_model: int = 32, n_layer: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model) for _ in range(n_layer))
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


def module_loss(loss, batch):
    """The module's output is its loss already."""
    return loss


def build_model(vocab_size: int = 64, d_model: int = 32, n_layer: int = 2, seed: int = 0) -> nn.Module:
    """The module; its scalar output is the loss, so no loss_fn is needed."""
    torch.manual_seed(seed)
    return TinyLM(vocab_size, d_model, n_layer)


class Rows(torch.utils.data.Dataset):
    """Random token rows as {"input_ids", "labels"} samples."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab_size, (size, seq_len), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_dataset(size: int = 256, seq_len: int = 16, vocab_size: int = 64):
    """A (train, validation) pair of map-style datasets."""
    return Rows(size, seq_len, vocab_size, 0), Rows(32, seq_len, vocab_size, 1)


def make_batch(rows: int, seed: int) -> dict:
    """A global batch of `rows` samples for the equivalence check, a function of `seed`."""
    ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


if __name__ == "__main__":  # the check's ranks start with spawn, which imports this file again
    import fspeed as fs
    from fspeed.testing import assert_trains_like_one_process

    assert_trains_like_one_process(build_model, fs.zero(3), make_batch=make_batch, loss_fn=module_loss,
                                   world_size=2)
    print("ZeRO-3 on 2 ranks trains like one process")
