"""A probe whose step calls sys.exit(0) at step 1 of every repeat: the audited code ending
the repeat, which must never read as a pass."""

import sys

import torch

import detaudit


def probe(device):
    model = torch.nn.Linear(4, 2)

    def step(model, batch):
        if step.calls == 1:
            sys.exit(0)
        step.calls += 1
        return model(batch).pow(2).mean()

    step.calls = 0
    g = torch.Generator().manual_seed(0)
    return detaudit.Probe(model=model, batches=[torch.randn(3, 4, generator=g) for _ in range(3)],
                          step=step, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
