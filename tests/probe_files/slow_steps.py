"""A small model whose steps take a while (for interrupting an audit at a chosen stage).
`DETAUDIT_TEST_STEP_SECONDS` sets the pause per step (default 0.5 s)."""

import os
import time

import torch

import detaudit

PAUSE = float(os.environ.get("DETAUDIT_TEST_STEP_SECONDS", "0.5"))


def probe(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]

    def step(model, batch):
        time.sleep(PAUSE)
        return model(batch).pow(2).mean()

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
