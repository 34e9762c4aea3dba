"""A probe whose second repeat crashes half way (state left over between repeats)."""

import torch

import detaudit

BUILT = {"count": 0}


def probe(device):
    BUILT["count"] += 1
    repeat = BUILT["count"]
    model = torch.nn.Linear(4, 2)

    def step(model, batch):
        if repeat == 2 and batch[0, 0] > -10 and step.calls == 1:
            raise RuntimeError("out of memory in the second repeat")
        step.calls += 1
        return model(batch).pow(2).mean()

    step.calls = 0
    g = torch.Generator().manual_seed(0)
    return detaudit.Probe(model=model, batches=[torch.randn(3, 4, generator=g) for _ in range(3)],
                          step=step, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
