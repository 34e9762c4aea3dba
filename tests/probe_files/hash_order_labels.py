"""Class names are mapped to label ids through a set: the order depends on PYTHONHASHSEED,
so the mapping is the same in every repeat inside one process and differs across processes."""

import torch
from torch import nn

import detaudit

CLASSES = ["person", "car", "bicycle", "dog", "cat", "truck", "bus", "horse"]


def probe(device):
    label_of = {name: i for i, name in enumerate(set(CLASSES))}
    model = nn.Linear(8, len(CLASSES)).to(device)
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(4, 8, generator=g) for _ in range(2)]
    names = [["person", "car", "dog", "bus"], ["cat", "truck", "horse", "bicycle"]]
    batches = [(x, torch.tensor([label_of[n] for n in ns])) for x, ns in zip(images, names)]

    def step(model, batch):
        x, labels = batch
        return nn.functional.cross_entropy(model(x.to(device)), labels.to(device))

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
