"""`fspeed-plot RUN_DIR`: PNGs of a run's metrics (loss and val loss, lr, throughput, breakdown).

    fspeed-plot outputs/2026-12-03/16-47-51              # writes outputs/.../plots/*.png
    fspeed-plot outputs/2026-12-03/16-47-51 --out figs
    fspeed-plot autotune                                 # a tuning: predicted against measured per layout
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from ..monitor import MissingExtraError
from ..plot import plot_run


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="fspeed-plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory of fspeed-train (holding metrics.csv), the CSV file, or "
                                        "fspeed-autotune's directory (holding results.json)")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        if (Path(args.run_dir) / "results.json").is_file():  # fspeed-autotune's directory
            from ..autotune.plots import plot_tuning  # noqa: PLC0415

            written = plot_tuning(args.run_dir, args.out)
        else:
            written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, KeyError, MissingExtraError) as err:
        print(f"fspeed-plot: {err}", file=sys.stderr)
        sys.exit(2)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
