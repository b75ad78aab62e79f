"""`fspeed`: the launcher entry point. `fspeed report` prints what this machine offers fspeed.

Multi-process launching (`fspeed --num_gpus N script.py`, `--hostfile`, torchrun under the hood)
is built by the distributed-core work; until then this command says so instead of guessing.
"""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata
from typing import Optional


def report() -> str:
    """Versions and capabilities relevant to fspeed (Python, torch, threads, CUDA, Numba)."""
    import torch

    lines = [f"python      {platform.python_version()} ({sys.executable})"]
    for package in ("fspeed", "torch", "optree", "numba", "hydra-core", "safetensors"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        lines.append(f"{package:<11} {version}")
    lines.append(f"threads     {torch.get_num_threads()} (torch intra-op)")
    cuda = torch.cuda.is_available()
    lines.append(f"cuda        {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'}")
    lines.append(f"bf16 on cpu {'yes' if torch.backends.mkldnn.is_available() else 'unknown'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="fspeed", description="fspeed launcher and tools")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("report", help="print versions and capabilities")
    args, rest = parser.parse_known_args(argv)
    if args.command == "report":
        print(report())
        return
    parser.exit(
        2,
        "fspeed: multi-process launching (--num_gpus, --hostfile, --include/--exclude) is not built yet; "
        "train on one process with `fspeed-train` or `python your_script.py`, or launch your script with "
        "`torchrun` directly.\n",
    )


if __name__ == "__main__":
    main()
