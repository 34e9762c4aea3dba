"""A plain inference script: a model in eval mode over a DataLoader under no_grad, no
optimizer anywhere. --race adds a duplicate-index accumulation (2 threads) to its forward."""

import argparse

import torch
from torch import nn


class Splat(nn.Module):
    """Features summed into 64 slots at 60,000 duplicate positions: index_put_ with
    accumulate, whose order of additions differs run to run on 2+ CPU threads."""

    def forward(self, h):
        slots = torch.zeros(64, h.shape[1])
        positions = torch.arange(60000) % 64
        values = torch.randn(60000, h.shape[1], generator=torch.Generator().manual_seed(0))
        return slots.index_put_((positions,), values * h.mean(), accumulate=True)


class Net(nn.Module):
    def __init__(self, race=False):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.splat = Splat() if race else None
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        if self.splat is not None:
            h = h + self.splat(h).sum(0, keepdim=True)
        return self.head(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--race", action="store_true")
    args = p.parse_args()
    if args.race:
        torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Net(args.race).eval()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(40, 8, generator=torch.Generator().manual_seed(1))),
        batch_size=8)
    with torch.no_grad():
        for (x,) in data:
            scores = model(x)
    print(f"last scores {scores.sum().item():.6f}")


if __name__ == "__main__":
    main()
