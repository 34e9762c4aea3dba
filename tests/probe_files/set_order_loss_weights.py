"""Loss weights zipped with a set of term names: which term gets which weight depends on the
set's order, so on PYTHONHASHSEED. Every repeat in one process agrees; repeats each in its
own process do not."""

import torch
from torch import nn

import detaudit

TERMS = ["cls", "box", "objectness", "rpn_box", "mask", "keypoint", "centerness", "aux"]
WEIGHTS = [1.0, 0.5, 0.25, 2.0, 0.125, 4.0, 0.75, 1.5]


def probe(device):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, len(TERMS))).to(device)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, generator=g) for _ in range(2)]

    def step(model, x):
        out = model(x.to(device))
        return {name: weight * out[:, TERMS.index(name)].pow(2).mean()
                for weight, name in zip(WEIGHTS, set(TERMS))}

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
