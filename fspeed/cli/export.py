"""`fspeed-export`: the full weights of any fspeed checkpoint (any layout) as safetensors.

    fspeed-export ck/latest model.safetensors --dtype bf16          # one file, streamed
    fspeed-export ck/global_step1000 out/ --max-shard-size 2GB       # HF-style shards + index
    fspeed-train checkpoint.init_from=model.safetensors              # fine-tune from them

Names are the parameter paths (a `functionalize`d module's `state_dict` names). A vocabulary
fspeed-train padded is written at its true size (`--keep-vocab-padding` keeps the padding rows);
the file's `fspeed_vocab` metadata records which. `fs.checkpoint.load_exported(path, model)` reads
the file back into the model's own parameter tree. See `fspeed.checkpoint.export`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional, Sequence

from fspeed.checkpoint import CheckpointError
from fspeed.checkpoint.export import export_weights
from fspeed.checkpoint.exported import VOCAB_FIELD
from fspeed.checkpoint.tensor_file import open_tensor_file

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """`2GB`, `500MiB`, `1000000` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 2GB, 500MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fspeed-export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, its 'latest' file, or a directory holding 'latest'")
    parser.add_argument("out", help="the .safetensors file to write (a directory with --max-shard-size)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the floating-point tensors written (default fp32)")
    parser.add_argument("--max-shard-size", type=parse_size, default=0,
                        help="split into shards of at most this size plus model.safetensors.index.json")
    parser.add_argument("--keep-vocab-padding", action="store_true",
                        help="keep the rows a padded vocabulary has beyond the tokenizer's (default: drop them)")
    args = parser.parse_args(argv)
    try:
        files = export_weights(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                               keep_vocab_padding=args.keep_vocab_padding)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"fspeed-export: {e}", file=sys.stderr)
        return 1
    for file in files:
        print(file)
    vocab = (open_tensor_file(files[0]).metadata() or {}).get(VOCAB_FIELD)
    if vocab:
        print(f"fspeed-export: {_vocab_line(json.loads(vocab))}", file=sys.stderr)
    return 0


def _vocab_line(vocab: dict) -> str:
    tensors = ", ".join(vocab["tensors"])
    if vocab["padding"] == "kept":
        return (f"vocabulary {vocab['size']}, padded to {vocab['padded_size']} rows: {tensors} written with the "
                "padding rows (--keep-vocab-padding)")
    return (f"vocabulary {vocab['size']}: {tensors} written with {vocab['size']} rows, the model's "
            f"{vocab['padded_size']} less its padding (--keep-vocab-padding keeps it)")


if __name__ == "__main__":
    sys.exit(main())
