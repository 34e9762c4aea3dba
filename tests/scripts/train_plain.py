"""A plain training script, as users write them: its own argparse, Dataset, DataLoader with
workers, loop, gradient accumulation (2 by default) and a scheduler. Seeds nothing unless --seed-self."""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Shapes(torch.utils.data.Dataset):
    def __init__(self, n, label_noise=False):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.label_noise = label_noise

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.label_noise:  # an unseeded generator: fresh entropy each time
            return self.x[i], (self.y[i] + int(np.random.default_rng().integers(0, 4))) % 4
        return self.x[i], self.y[i]


class CentreGather(nn.Module):
    """Features gathered at many duplicate positions: the backward accumulates with
    index_put_, which differs run to run on 2+ CPU threads."""

    def forward(self, features):
        n, c, h, w = features.shape
        rows = torch.arange(6000) * 7 % (n * h * w)
        weights = torch.linspace(-1, 1, 6000 * c).reshape(6000, c)
        gathered = features.permute(0, 2, 3, 1).reshape(n * h * w, c)[rows]
        return (gathered * weights).mean(0, keepdim=True)


class Net(nn.Module):
    def __init__(self, race=False, tied=False):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gather = CentreGather() if race else None
        self.classes = nn.Embedding(4, 8) if tied else None  # a class prior, tied to the head
        self.head = nn.Linear(8, 4, bias=not tied)
        if tied:
            self.classes.weight = self.head.weight

    def forward(self, x):
        features = torch.relu(self.stem(x))
        pooled = features.mean((2, 3))
        if self.gather is not None:
            pooled = pooled + self.gather(features)
        if self.classes is not None:  # (detached: the tied weight's gradient is the head's
            # own weight-gradient op's output, which no sum can round a 1-ULP change out of)
            pooled = (pooled + self.classes(torch.arange(4)).mean(0)).detach()
        return self.head(pooled)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    p.add_argument("--seed-self", action="store_true")
    p.add_argument("--forever", action="store_true", help="loop until stopped, catching exits")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long each step")
    p.add_argument("--crash-at", type=int, help="raise in the backward of this optimizer step")
    p.add_argument("--race", action="store_true", help="a duplicate-index gather (2 threads)")
    p.add_argument("--tied", action="store_true", help="a layer sharing the head's weight")
    p.add_argument("--by-hand", action="store_true", help="SGD written out, no torch.optim")
    p.add_argument("--label-noise", action="store_true", help="unseeded noise in the labels")
    p.add_argument("--compile", choices=("wrapper", "in-place", "function", "step"),
                   help="torch.compile(model), model.compile(), or torch.compile of the "
                   "function that calls the model and computes the loss (function), and calls "
                   "backward on it too (step); the aot_eager backend")
    p.add_argument("--spawn", action="store_true", help="DataLoader workers started by spawn")
    p.add_argument("--evaluated", help="a file written after each evaluation")
    p.add_argument("--resume", help="a checkpoint saved after each epoch, resumed from if found")
    p.add_argument("--resume-progress-only", action="store_true",
                   help="the checkpoint holds the epoch reached, not the weights")
    args = p.parse_args()
    if args.seed_self:
        torch.manual_seed(0)
    if args.race:
        torch.set_num_threads(2)
    model = Net(args.race, args.tied)
    if args.compile == "wrapper":
        model = torch.compile(model, backend="aot_eager")
    elif args.compile == "in-place":
        model.compile(backend="aot_eager")
    def loss_of(x, y):
        return nn.functional.cross_entropy(model(x), y) / args.accumulate

    def backward_of(x, y, crash=False):
        loss = loss_of(x, y)
        if crash:  # (raised inside backward, as a hook's or a custom Function's error is)
            loss.register_hook(bug)
        loss.backward()
        return loss

    def bug(grad):
        raise RuntimeError("the script's own bug")

    if args.compile == "function":
        loss_of = torch.compile(loss_of, backend="aot_eager")
    elif args.compile == "step":
        backward_of = torch.compile(backward_of, backend="aot_eager")
    opt = None if args.by_hand else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = None if args.by_hand else torch.optim.lr_scheduler.StepLR(opt, 1)

    def update():
        if opt is not None:
            opt.step()
            opt.zero_grad()
            return
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None

    loader = torch.utils.data.DataLoader(
        Shapes(16, args.label_noise), batch_size=4, num_workers=args.workers,
        multiprocessing_context="spawn" if args.spawn and args.workers else None,
        persistent_workers=args.spawn and args.workers > 0)
    steps = 0
    epoch = 0
    if args.resume and Path(args.resume).exists():
        saved = torch.load(args.resume)
        epoch = saved["epoch"]
        if "model" in saved:
            model.load_state_dict(saved["model"])
    while epoch < args.epochs or args.forever:
        model.train()
        for i, (x, y) in enumerate(loader):
            try:
                updating = i % args.accumulate == args.accumulate - 1
                backward_of(x, y, crash=updating and steps == args.crash_at)
                if updating:
                    update()
                    steps += 1
                    time.sleep(args.step_seconds)
            except (SystemExit, KeyboardInterrupt):
                pass  # a script that swallows every way out
        if sched is not None:
            sched.step()
        model.eval()
        with torch.no_grad():  # evaluation between epochs: not a training step
            model(torch.zeros(2, 3, 16, 16))
        if args.evaluated:
            Path(args.evaluated).write_text(f"evaluated after epoch {epoch}")
        if args.resume:
            weights = {} if args.resume_progress_only else {"model": model.state_dict()}
            torch.save({"epoch": epoch + 1, **weights}, args.resume)
        epoch += 1
    print(f"trained {steps} steps")


if __name__ == "__main__":
    main()
