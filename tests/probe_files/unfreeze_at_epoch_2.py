"""A recipe whose nondeterministic path only runs from the second epoch: the centre head
joins training when the backbone is unfrozen at epoch 2."""

import torch
from torch import nn

import detaudit


class CentreHead(nn.Module):
    def forward(self, features, centres):
        n, c, h, w = features.shape
        return features.permute(0, 2, 3, 1).reshape(n * h * w, c)[centres]


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Conv2d(3, 16, 3, padding=1)
        self.centre_head = CentreHead()
        self.box_head = nn.Linear(16, 4)
        self.unfrozen = False

    def forward(self, images, centres):
        features = self.backbone(images)
        if not self.unfrozen:
            features = features.detach()  # frozen: no gradient flows into the gather
        return self.box_head(self.centre_head(features, centres))


def probe(device):
    torch.set_num_threads(2)
    model = Detector().to(device)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(1, 3, 32, 32, generator=g), torch.randint(0, 64, (4000,), generator=g),
             torch.randn(4000, 4, generator=g)) for _ in range(2)]

    def batches(epoch):
        model.unfrozen = epoch >= 1
        return data

    def step(model, batch):
        images, centres, boxes = (t.to(device) for t in batch)
        return (model(images, centres) - boxes).pow(2).mean()

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
