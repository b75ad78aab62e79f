"""Third-party models for the tests, built from configs with random weights (no download): a Hugging
Face GPT-2 (tied embeddings, transposed Conv1D), a Llama (rotary buffers, grouped-query attention,
a tp_plan) and a small ResNet-style CNN with BatchNorm buffers; and plain PyTorch loops to compare with."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


def quiet_transformers():
    """transformers, quiet, and blind to this repository's top-level `kernels/` folder: pytest puts
    the repository root on sys.path (`pythonpath = ["."]`), where transformers would take fspeed's
    Numba kernels for Hugging Face's `kernels` package and fail importing from it."""
    import transformers
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    for owner in (utils, import_utils):
        owner.is_kernels_available = lambda *args, **kwargs: False
    transformers.logging.set_verbosity_error()
    return transformers


def hf_gpt2(seed: int = 0, dropout: float = 0.0, layers: int = 2) -> nn.Module:
    transformers = quiet_transformers()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama(seed: int = 0, layers: int = 2, tied: bool = False, attention: Optional[str] = None) -> nn.Module:
    transformers = quiet_transformers()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   tie_word_embeddings=tied)
    if attention is not None:
        cfg._attn_implementation = attention
    return transformers.LlamaForCausalLM(cfg)


class Block(nn.Module):
    """conv - batchnorm - relu with a residual: the repeated unit of the CNN."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 2, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def small_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN()


def lm_loss(outputs, batch):
    return outputs.loss


def cnn_loss(outputs, batch):
    return F.cross_entropy(outputs.float(), batch[1])


def lm_batch(rows: int, seed: int) -> dict:
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "labels": x}


def cnn_batch(rows: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 6, 6, generator=g), torch.randint(0, 5, (rows,), generator=g)


MODELS = {
    "gpt2": (hf_gpt2, lm_loss, lm_batch),
    "llama": (hf_llama, lm_loss, lm_batch),
    "cnn": (small_cnn, cnn_loss, cnn_batch),
}


def split(batch, parts: int, index: int):
    """The index-th of `parts` equal row chunks of a dict or tuple batch."""
    if isinstance(batch, dict):
        return {k: v.chunk(parts)[index] for k, v in batch.items()}
    return tuple(v.chunk(parts)[index] for v in batch)


def torch_loop(module: nn.Module, loss_fn, batches, grad_accum: int, lr: float = 1e-3,
               weight_decay: float = 0.0, clip: float = 0.0) -> nn.Module:
    """A plain PyTorch training loop: AdamW (the single-tensor reference), gradient accumulation
    over `grad_accum` equal micro-batches of each batch, optional global-norm clipping."""
    module = copy.deepcopy(module).train()
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    for batch in batches:
        opt.zero_grad()
        for i in range(grad_accum):
            micro = split(batch, grad_accum, i)
            outputs = module(**{k: v for k, v in micro.items()}) if isinstance(micro, dict) else module(micro[0])
            (loss_fn(outputs, micro) / grad_accum).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
    return module


def with_fused_gelu(module: nn.Module) -> nn.Module:
    """A copy of `module` whose Python tanh-GELUs are torch's fused one: what `functionalize`
    computes by default (`fspeed.models.fused_ops`), for plain loops to compare with."""
    from fspeed.models.fused_ops import fused_forward

    module = copy.deepcopy(module)
    for path, sub in list(module.named_modules()):
        if path and fused_forward(sub) is not None:
            parent, _, name = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, name, nn.GELU(approximate="tanh"))
    return module


def call(module: nn.Module, batch):
    return module(**batch) if isinstance(batch, dict) else module(batch[0])


class LMDataset(torch.utils.data.Dataset):
    """Random token rows as a map-style dataset of Hugging Face batches (input_ids, labels)."""

    def __init__(self, size: int, seed: int):
        self.rows = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def lm_datasets(size: int = 256, seed: int = 0) -> tuple[LMDataset, LMDataset]:
    """(train, validation): fspeed-train's data._target_ for the language models."""
    return LMDataset(size, seed), LMDataset(32, seed + 1)


class _GPT2Embed(nn.Module):
    """GPT-2's token and position embeddings as one layer (its `wte` is also the head's weight)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class _FirstOutput(nn.Module):
    """A Hugging Face block returning (hidden, ...) as a layer returning the hidden state."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def hf_gpt2_layers(seed: int = 0, layers: int = 3, dropout: float = 0.0, fused: Optional[bool] = None):
    """A Hugging Face GPT-2 as a pipeline layer list (DeepSpeed's PipelineModule, fspeed's `sequential`):
    embeddings, blocks, final norm, and the head tied to the token embedding (TiedLayer). `fused`:
    the loss is fs.causal_lm_loss on batches with labels (`lm_labels_batch`), the head fused with it
    (True, `head_of`) or not (False: the head a lambda, the loss of its logits)."""
    import fspeed as fs

    gpt2 = hf_gpt2(seed, dropout, layers=layers).transformer
    embed = _GPT2Embed(gpt2.wte, gpt2.wpe)
    head = fs.models.head_of("wte.weight") if fused else lambda m, x: x @ m.wte.weight.t()
    loss_fn = (lambda logits, batch: F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())) \
        if fused is None else fs.causal_lm_loss if fused else (lambda logits, batch: fs.causal_lm_loss(logits, batch))
    return fs.models.sequential(
        [fs.models.TiedLayer("embed", embed), *[_FirstOutput(b) for b in gpt2.h], gpt2.ln_f,
         fs.models.TiedLayer("embed", embed, forward=head)], loss_fn=loss_fn, name="hf-gpt2-layers")


def lm_labels_batch(rows: int, seed: int) -> dict:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"inputs": ids, "labels": ids}


def lm_dict_batch(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def hf_gpt2_traced(seed: int = 0, layers: int = 3, dropout: float = 0.0, rows: int = 2):
    """The Hugging Face GPT-2 itself, traced and cut before each block (`fs.models.traced_layers`):
    no hand-written layer list; its own loss from the labels."""
    import fspeed as fs

    return fs.models.traced_layers(hf_gpt2(seed, dropout, layers=layers), lm_batch(rows, 0))


def hf_llama_traced(seed: int = 0, layers: int = 3, rows: int = 2):
    import fspeed as fs

    return fs.models.traced_layers(hf_llama(seed, layers=layers), lm_batch(rows, 0))



def hf_llama_layers(seed: int = 0, layers: int = 3, tied: bool = False, fused: bool = True):
    """A Hugging Face Llama as a pipeline layer list with its own tp_plan (`fs.models.decoder_layers`),
    on `lm_batch`es: the head fused with causal_lm_loss (over its vocabulary slices when sliced) or
    not (its logits gathered whole for the loss); tied, the embedding is also the head."""
    import fspeed as fs

    loss_fn = fs.causal_lm_loss if fused else (lambda logits, batch: fs.causal_lm_loss(logits, batch))
    return fs.models.decoder_layers(hf_llama(seed, layers=layers, tied=tied), loss_fn=loss_fn)
