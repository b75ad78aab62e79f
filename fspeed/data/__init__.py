"""Datasets, tokenizers and deterministic, rank-aware batch loading."""

from fspeed.data.corpus import (
    DEFAULT_MAX_BYTES,
    CorpusDecodeError,
    CorpusError,
    corpus_file_bytes,
    decode_corpus,
    stdlib_corpus,
    stdlib_corpus_bytes,
    stdlib_dir,
    stdlib_files,
    text_corpus,
)
from fspeed.data.loader import (
    Batch,
    BatchSampler,
    DatasetRows,
    Loader,
    TokenWindows,
    eval_starts,
    split_train_val,
)
from fspeed.data.curriculum import CurriculumSchedule, difficulty_at, truncate_to_seqlen
from fspeed.data.difficulty import CurriculumSampler, compute_metric, metric_index
from fspeed.data.epochs import EpochLoader, EpochSampler, data_coordinates, loader
from fspeed.data.tokenizer import (
    TOKENIZER_KINDS,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    UnknownCharacterError,
    make_tokenizer,
    tokenizer_from_dict,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TOKENIZER_KINDS",
    "Batch",
    "CorpusDecodeError",
    "CorpusError",
    "CurriculumSampler",
    "CurriculumSchedule",
    "BatchSampler",
    "DatasetRows",
    "EpochLoader",
    "EpochSampler",
    "ByteTokenizer",
    "CharTokenizer",
    "Loader",
    "TokenWindows",
    "Tokenizer",
    "UnknownCharacterError",
    "compute_metric",
    "corpus_file_bytes",
    "data_coordinates",
    "difficulty_at",
    "decode_corpus",
    "eval_starts",
    "loader",
    "make_tokenizer",
    "metric_index",
    "split_train_val",
    "stdlib_corpus",
    "stdlib_corpus_bytes",
    "stdlib_dir",
    "stdlib_files",
    "text_corpus",
    "tokenizer_from_dict",
    "truncate_to_seqlen",
]
