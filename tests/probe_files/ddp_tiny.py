"""A small DDP training set-up in the rank-aware form, and variants with the bugs a
distributed audit must find. `--probe ddp_tiny.py` is the correct one; the variants are
`ddp_tiny.py:no_set_epoch`, `:same_augment_seed`, `:desync` and `:crash`."""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import detaudit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.features(x)).mean((2, 3)))


class FlipData(Dataset):
    """8 fixed images, each flipped left to right with probability 1/2 (global torch RNG)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(8, 3, 8, 8, generator=g)
        self.labels = torch.arange(8) % 2

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        image = self.images[index]
        if torch.rand(1).item() < 0.5:
            image = image.flip(-1)
        return image, self.labels[index]


def build(device, rank, world_size, set_epoch=True, rank_seed=True):
    model = Net().to(device)  # built from detaudit's common seed: the same on every rank
    torch.manual_seed(1000 + (rank if rank_seed else 0))  # augmentation: one stream per rank
    data = FlipData()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=2, sampler=sampler)

    def batches(epoch):
        if set_epoch:
            sampler.set_epoch(epoch)
        return loader

    def step(model, batch):
        x, y = (t.to(device) for t in batch)
        return nn.functional.cross_entropy(model(x), y)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return detaudit.Probe(model=model, batches=batches, step=step, optimizer=optimizer)


def probe(device, rank, world_size):
    return build(device, rank, world_size)


def no_set_epoch(device, rank, world_size):
    """The sampler's epoch is never set: every epoch repeats the first one's order."""
    return build(device, rank, world_size, set_epoch=False)


def same_augment_seed(device, rank, world_size):
    """Every rank seeds its augmentation alike: all ranks flip the same way."""
    return build(device, rank, world_size, rank_seed=False)


def desync(device, rank, world_size):
    """Rank 1 nudges head.weight right after the optimizer step of global step 2."""
    built = build(device, rank, world_size)
    net = built.model
    updates = {"done": 0}

    def nudge(optimizer, args, kwargs):
        if rank == 1 and updates["done"] == 2:
            with torch.no_grad():
                net.head.weight[0, 0] += 1e-3
        updates["done"] += 1

    built.optimizer.register_step_post_hook(nudge)
    return built


BUILT = {"count": 0}


def crash(device, rank, world_size):
    """Rank 1 raises in the second step of the second repeat."""
    repeat = BUILT["count"]
    BUILT["count"] += 1
    built = build(device, rank, world_size)
    train_step = built.step
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        if rank == 1 and repeat == 1 and calls["n"] == 2:
            raise RuntimeError("rank 1 lost its device")
        return train_step(model, batch)

    built.step = step
    return built
