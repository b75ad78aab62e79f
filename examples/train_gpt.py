"""The Hydra-configured training job as a script: the same as `fspeed-train`, overrides included.

    python examples/train_gpt.py train.steps=200 optimizer=lamb
    fspeed --num_gpus 4 examples/train_gpt.py zero.stage=3               # 4 data-parallel ranks
    fspeed --num_gpus 4 examples/train_gpt.py parallel.tensor=2 zero.stage=1   # DP=2 x TP=2

Copy examples/train_gpt_api.py instead to see (and change) every step in plain Python.
"""

from fspeed.cli.train import main

if __name__ == "__main__":
    main()
