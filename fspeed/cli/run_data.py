"""The data of a training run, prepared before any rank starts work: corpus, tokenizer, windows.

Every problem a user can fix is a `ConfigError` naming the config key and the path: a missing,
empty, directory or binary corpus (`data.corpus`, with the first bad byte's offset), a corpus too
short for `model.seq_len`, a `data.max_bytes` below the first standard-library file. With the
byte tokenizer the corpus' bytes are the tokens, as they are; with the char tokenizer it is
decoded as UTF-8 (`data.errors`: strict, or replace for U+FFFD). A resumed run takes the
tokenizer saved in its checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .. import data
from ..config import ConfigError, Problem
from ..config.schema import RunConfig

_DECODE_HINT = ("set data.errors=replace to read invalid bytes as U+FFFD, or data.tokenizer=byte to train on the "
                "file's bytes")


@dataclass(frozen=True)
class RunData:
    """What training reads: the tokenizer, the token count, and the train and validation windows."""

    tokenizer: data.Tokenizer
    num_tokens: int
    train: data.TokenWindows
    val: data.TokenWindows


def _tokens(run: RunConfig, saved_tokenizer: Optional[Mapping[str, Any]]):
    d = run.data
    kind = saved_tokenizer.get("kind") if saved_tokenizer is not None else d.tokenizer
    if d.corpus == "stdlib":
        limit = d.max_bytes or 10**12
        if kind == "byte":
            return data.ByteTokenizer(), data.ByteTokenizer().encode_bytes(data.stdlib_corpus_bytes(limit))
        text = data.stdlib_corpus(limit, errors=d.errors)
    else:
        raw, truncated = data.corpus_file_bytes(d.corpus, d.max_bytes)
        if kind == "byte":
            return data.ByteTokenizer(), data.ByteTokenizer().encode_bytes(raw)
        text = data.decode_corpus(raw, d.corpus, errors=d.errors, truncated=truncated)
    tokenizer = data.tokenizer_from_dict(saved_tokenizer) if saved_tokenizer is not None \
        else data.make_tokenizer(kind, text)
    return tokenizer, tokenizer.encode(text)


def prepare_data(run: RunConfig, saved_tokenizer: Optional[Mapping[str, Any]] = None) -> RunData:
    """Read, tokenize and split the run's corpus; ConfigError naming the key for a user's problem."""
    d, seq_len = run.data, run.model.seq_len
    try:
        tokenizer, tokens = _tokens(run, saved_tokenizer)
    except data.CorpusDecodeError as e:
        raise ConfigError([Problem("data.corpus", e.reason, e.path, hint=_DECODE_HINT)]) from None
    except data.CorpusError as e:
        raise ConfigError([Problem("data.corpus", e.reason, e.path)]) from None
    except data.UnknownCharacterError as e:
        raise ConfigError([Problem("data.corpus", f"does not fit the tokenizer of the checkpoint being resumed: {e}",
                                   d.corpus)]) from None
    except FileNotFoundError as e:  # the standard library cannot be found
        raise ConfigError([Problem("data.corpus", str(e), d.corpus)]) from None
    except ValueError as e:  # max_bytes below the first standard-library file
        raise ConfigError([Problem("data.max_bytes", str(e), d.max_bytes)]) from None
    try:
        train_tokens, val_tokens = data.split_train_val(tokens, d.val_fraction, min_tokens=seq_len + 1)
    except ValueError as e:
        raise ConfigError([Problem("data.corpus", f"too short for model.seq_len={seq_len} with data.val_fraction="
                                   f"{d.val_fraction} and data.max_bytes={d.max_bytes}: {e}", d.corpus)]) from None
    return RunData(tokenizer, len(tokens), data.TokenWindows(train_tokens, seq_len),
                   data.TokenWindows(val_tokens, seq_len))
