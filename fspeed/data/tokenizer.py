"""Byte- and character-level tokenizers, vectorised with numpy and storable as JSON.

Both map text to a 1-D ``torch.long`` tensor of ids and back. ``to_dict()`` gives a JSON-safe
description that ``tokenizer_from_dict`` turns back into the same tokenizer, so a checkpoint's
metadata can carry its vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

# Python strings may hold lone surrogates; UTF-32 with "surrogatepass" maps every str to its
# code points and back, so CharTokenizer round-trips any str.
_UTF32 = "utf-32-le"
_CODEPOINT = np.dtype("<u4")
_MAX_CODEPOINT = 0x10FFFF

TokenIds = torch.Tensor | np.ndarray | Sequence[int]


class UnknownCharacterError(ValueError):
    """Text to encode holds a character that is not in the tokenizer's vocabulary."""

    def __init__(self, char: str, position: int, vocab_size: int) -> None:
        self.char = char
        self.position = position
        super().__init__(
            f"character {char!r} (U+{ord(char):04X}) at position {position} is not in the "
            f"tokenizer's vocabulary of {vocab_size} characters; build the CharTokenizer from text "
            "that contains it, or use the byte tokenizer"
        )


def _codepoints(text: str) -> np.ndarray:
    """The code points of ``text`` as a uint32 array."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return np.frombuffer(text.encode(_UTF32, "surrogatepass"), dtype=_CODEPOINT)


def _ids_as_numpy(ids: TokenIds, vocab_size: int) -> np.ndarray:
    """Validate token ids (1-D, integer, in [0, vocab_size)) and return them as an int64 array."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
        array = ids.detach().cpu().numpy()
    else:
        array = np.asarray(ids)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    out_of_range = (array < 0) | (array >= vocab_size)
    if out_of_range.any():
        position = int(np.argmax(out_of_range))
        raise ValueError(
            f"token id {int(array[position])} at position {position} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return array.astype(np.int64, copy=False)


def _check_kind(d: Mapping[str, Any], kind: str) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"a tokenizer description must be a mapping, got {type(d).__name__}")
    if d.get("kind") != kind:
        raise ValueError(f"expected a tokenizer description with kind={kind!r}, got kind={d.get('kind')!r}")


@dataclass(frozen=True)
class ByteTokenizer:
    """The 256 byte values of the text's UTF-8 encoding; any text encodes, nothing to store."""

    vocab_size: ClassVar[int] = 256
    kind: ClassVar[str] = "byte"

    def encode(self, text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a 1-D long tensor (lone surrogates raise UnicodeEncodeError)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(raw.astype(np.int64))

    def encode_bytes(self, raw: bytes) -> torch.Tensor:
        """The bytes ``raw`` as they are (a file's bytes, valid UTF-8 or not), as a 1-D long tensor."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise TypeError(f"raw must be bytes, got {type(raw).__name__}")
        return torch.from_numpy(np.frombuffer(bytes(raw), dtype=np.uint8).astype(np.int64))

    def decode(self, ids: TokenIds) -> str:
        """Text of the bytes ``ids``; invalid UTF-8 (e.g. from sampling) becomes U+FFFD."""
        array = _ids_as_numpy(ids, self.vocab_size)
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ByteTokenizer:
        _check_kind(d, cls.kind)
        return cls()


@dataclass(frozen=True)
class CharTokenizer:
    """One id per distinct character; ``chars`` holds the vocabulary sorted by code point."""

    chars: str
    kind: ClassVar[str] = "char"
    _codepoints: np.ndarray = field(init=False, repr=False, compare=False)
    _ids_by_codepoint: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.chars, str):
            raise TypeError(f"chars must be a str, got {type(self.chars).__name__}")
        if not self.chars:
            raise ValueError("chars must hold at least one character, got an empty string")
        codepoints = _codepoints(self.chars)
        not_increasing = np.flatnonzero(np.diff(codepoints.astype(np.int64)) <= 0)
        if not_increasing.size:
            at = int(not_increasing[0]) + 1
            raise ValueError(
                f"chars must be unique and sorted by code point; {self.chars[at]!r} at position {at} "
                f"follows {self.chars[at - 1]!r} (use CharTokenizer.from_text)"
            )
        # A lookup table from code point to id (-1 for none): one gather encodes a whole text.
        lookup = np.full(int(codepoints[-1]) + 1, -1, dtype=np.int64)
        lookup[codepoints] = np.arange(codepoints.size, dtype=np.int64)
        object.__setattr__(self, "_codepoints", codepoints)
        object.__setattr__(self, "_ids_by_codepoint", lookup)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is exactly the distinct characters of ``text``."""
        codepoints = _codepoints(text)
        if codepoints.size == 0:
            raise ValueError("cannot build a CharTokenizer from empty text")
        seen = np.zeros(_MAX_CODEPOINT + 1, dtype=bool)
        seen[codepoints] = True
        vocab = np.flatnonzero(seen).astype(_CODEPOINT)
        return cls(vocab.tobytes().decode(_UTF32, "surrogatepass"))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of the characters of ``text``; UnknownCharacterError names the first unknown one."""
        codepoints = _codepoints(text)
        lookup = self._ids_by_codepoint
        beyond_table = codepoints >= lookup.size
        ids = lookup[np.minimum(codepoints, np.uint32(lookup.size - 1))]
        unknown = (ids < 0) | beyond_table
        if unknown.any():
            position = int(np.argmax(unknown))
            raise UnknownCharacterError(text[position], position, self.vocab_size)
        return torch.from_numpy(ids)

    def decode(self, ids: TokenIds) -> str:
        """The text whose characters have the ids ``ids``."""
        array = _ids_as_numpy(ids, self.vocab_size)
        return self._codepoints[array].tobytes().decode(_UTF32, "surrogatepass")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CharTokenizer:
        _check_kind(d, cls.kind)
        if "chars" not in d:
            raise ValueError("a char tokenizer description needs a 'chars' entry holding the vocabulary")
        return cls(d["chars"])


Tokenizer = ByteTokenizer | CharTokenizer
TOKENIZER_KINDS: tuple[str, ...] = (CharTokenizer.kind, ByteTokenizer.kind)


def make_tokenizer(kind: str, text: str | None = None) -> Tokenizer:
    """A tokenizer of ``kind`` ("char": vocabulary from ``text``; "byte": ``text`` is not needed)."""
    if kind == CharTokenizer.kind:
        if text is None:
            raise ValueError("the 'char' tokenizer needs the corpus text to build its vocabulary")
        return CharTokenizer.from_text(text)
    if kind == ByteTokenizer.kind:
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r}; allowed: {', '.join(map(repr, TOKENIZER_KINDS))}")


def tokenizer_from_dict(d: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by a ``to_dict()`` result (e.g. read back from checkpoint metadata)."""
    if not isinstance(d, Mapping):
        raise TypeError(f"a tokenizer description must be a mapping, got {type(d).__name__}")
    kind = d.get("kind")
    if kind == CharTokenizer.kind:
        return CharTokenizer.from_dict(d)
    if kind == ByteTokenizer.kind:
        return ByteTokenizer.from_dict(d)
    raise ValueError(f"unknown tokenizer kind {kind!r}; allowed: {', '.join(map(repr, TOKENIZER_KINDS))}")
