"""`fspeed-import-deepspeed`: a DeepSpeed checkpoint (ZeRO 0-3, Adam/AdamW) as an fspeed checkpoint.

    fspeed-import-deepspeed ds_ckpt/global_step1000 ck      # or ds_ckpt (its 'latest')
    fspeed-train checkpoint.dir=ck checkpoint.resume=true ...                  # any layout

Weights, fp32 masters, Adam moments and the counters carry over; DeepSpeed is not needed (its
pickles are read with a restricted unpickler). See `fspeed.checkpoint.deepspeed_import`. A
`PipelineModule`'s checkpoint at ZeRO 1-2 converts too, in `fs.models.sequential`'s names; one at
ZeRO 0 names no parameter in its optimizer files and needs the layer list
(`fs.checkpoint.import_deepspeed(..., model=...)`, `fspeed.checkpoint.deepspeed_pipeline`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fspeed.checkpoint import CheckpointError
from fspeed.checkpoint.deepspeed_import import convert_deepspeed


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fspeed-import-deepspeed", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a DeepSpeed checkpoint tag directory, or the directory holding 'latest'")
    parser.add_argument("out", help="the fspeed checkpoint directory to write (its 'latest' names the new tag)")
    parser.add_argument("--tag", default=None, help="the tag to write (default global_step<N> as saved)")
    args = parser.parse_args(argv)
    try:
        path = convert_deepspeed(args.source, args.out, tag=args.tag)
    except (CheckpointError, OSError) as e:
        print(f"fspeed-import-deepspeed: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
