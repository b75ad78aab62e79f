"""A DeepSpeed training script moved to fspeed by changing one line: the import.

    fspeed --num_gpus 2 examples/deepspeed_script_moved_over.py --deepspeed --deepspeed_config examples/ds_config.json
    fspeed --num_gpus 1 examples/deepspeed_script_moved_over.py --deepspeed_config examples/ds_config.json --resume

With `import deepspeed` instead, the same file runs under DeepSpeed's launcher (`deepspeed --num_gpus 2
examples/deepspeed_script_moved_over.py ...`). What the script uses of DeepSpeed's API, and fspeed
provides: `add_config_arguments`, `init_distributed()`, `initialize(args=, model=, model_parameters=,
training_data=)` returning (engine, optimizer, loader, lr scheduler), and the engine's
`engine(**batch)`, `backward`, `step`, `device`, `global_rank`, `global_steps`, `get_lr`,
`save_checkpoint` and `load_checkpoint` (which also reads a checkpoint DeepSpeed itself saved; the
second command above resumes the 2-rank run's checkpoint on one rank).

Lines of a DeepSpeed script that do need changing (this one avoids them):

- `outputs = engine(inputs); loss = criterion(outputs, labels)`: fspeed's engine takes the forward and
  the backward together, so the loss must be computed inside it. Return the loss from `forward` (as
  here), or pass `loss_fn=lambda outputs, batch: criterion(outputs, batch[1])` to `initialize` and
  call `loss = engine((inputs, labels))`.
- `loss = engine(**batch).loss` (a Hugging Face model): the engine returns the loss itself,
  `loss = engine(**batch)`.
- evaluating through the engine (`engine.eval()`, a forward under `torch.no_grad()`):
  `engine.eval_batch(batch)` returns the loss, `engine.module` is the trained `nn.Module`.
- `deepspeed.init_distributed(dist_backend=...)`: fspeed's takes `backend=` (gloo on a CPU; NCCL for
  CUDA tensors); without a launcher (plain `python script.py`) leave the call out, as
  `initialize` needs no process group on one process.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import fspeed as deepspeed  # was: import deepspeed


class Classifier(nn.Module):
    """An MLP over points; `forward(x, labels)` returns the loss, as DeepSpeed's engine expects."""

    def __init__(self, dim: int, width: int, classes: int, depth: int):
        super().__init__()
        layers = [nn.Linear(dim, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(self.body(x)), labels)


class Clusters(torch.utils.data.Dataset):
    """Points drawn around one random centre per class (the same data on every rank)."""

    def __init__(self, samples: int, dim: int, classes: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=g)
        self.labels = torch.randint(0, classes, (samples,), generator=g)
        self.x = centres[self.labels] + 0.8 * torch.randn(samples, dim, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def main():
    parser = argparse.ArgumentParser(description="My training script.")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--save_dir", default="checkpoints/moved_over")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()

    deepspeed.init_distributed()
    model = Classifier(dim=32, width=args.width, classes=10, depth=3)
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=Clusters(args.samples, 32, 10))

    first_epoch = 0
    if args.resume and os.path.exists(os.path.join(args.save_dir, "latest")):
        _, client_state = model_engine.load_checkpoint(args.save_dir)
        first_epoch = client_state["epoch"] + 1

    for epoch in range(first_epoch, first_epoch + args.epochs):
        for step, batch in enumerate(trainloader):
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            loss = model_engine(**batch)
            model_engine.backward(loss)
            model_engine.step()
        if model_engine.global_rank == 0:
            print(f"epoch {epoch}: step {model_engine.global_steps}, loss {loss.item():.4f}, "
                  f"lr {model_engine.get_lr()[0]:.2e}")
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})

    # leave together (plain torch.distributed, as under DeepSpeed): a gloo rank that exits with its
    # process group still up can die in its teardown (SIGABRT) after all its work is done
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
