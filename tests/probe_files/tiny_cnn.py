"""A small deterministic probe: conv blocks and a linear head on fixed random data."""

import torch
from torch import nn

import detaudit


def probe(device):
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    ).to(device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 16, 16, generator=g), torch.tensor([0, 2])) for _ in range(2)]

    def step(model, batch):
        x, y = (t.to(device) for t in batch)
        out = model(x)
        return nn.functional.cross_entropy(out, y) if model.training else out

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
