"""A user probe: a head that gathers features at object centres (duplicate indices).

Its backward accumulates with index_put_ over duplicate indices, which differs run to run
on 2+ CPU threads.
"""

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
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.centre_head = CentreHead()
        self.box_head = nn.Linear(16, 4)

    def forward(self, images, centres):
        return self.box_head(self.centre_head(self.backbone(images), centres))


def probe(device):
    torch.set_num_threads(2)
    model = Detector().to(device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(1, 3, 32, 32, generator=g), torch.randint(0, 64, (4000,), generator=g),
                torch.randn(4000, 4, generator=g)) for _ in range(4)]

    def step(model, batch):
        images, centres, boxes = (t.to(device) for t in batch)
        return {"box_loss": (model(images, centres) - boxes).pow(2).mean()}

    return detaudit.Probe(model=model, batches=batches, step=step,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
