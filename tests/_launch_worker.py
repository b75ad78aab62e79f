"""Worker launched by tests/test_launcher.py: one gloo all_reduce, then a JSON record of what this rank got.

    _launch_worker.py OUT_DIR [--fail-rank R] [extra args, recorded]

Writes OUT_DIR/rank<RANK>.json with the torchrun environment, the all_reduce result of
(rank + 1) over the world and the arguments it received. `--fail-rank R` makes rank R exit
with code 3 before the all_reduce, as a rank dying mid-step would (the others then fail in it).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "FSPEED_TEST_MARK", "FSPEED_AGENT_REPORT")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fail-rank", type=int, default=-1)
    args, extra = parser.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == args.fail_rank:
        sys.exit(3)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {"rank": rank, "world": world, "all_reduce": value.item(), "argv": sys.argv[1:], "extra": extra,
              "env": {key: os.environ.get(key) for key in ENV_KEYS}}
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
    os.replace(path + ".tmp", path)
    print(f"worker rank {rank} of {world} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
