"""A heavier plain training script for the exec benchmark: ResNet-18 on seeded synthetic
images (64 px by default, on the CPU unless --device), SGD with momentum, a DataLoader with workers."""

import argparse

import torch
import torchvision
from torch import nn


class Cycled(torch.utils.data.Dataset):
    """`length` items taken from `images` and `labels` in turn."""

    def __init__(self, images, labels, length):
        self.images, self.labels, self.length = images, labels, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.images[i % len(self.images)], self.labels[i % len(self.labels)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", type=int, default=64, help="image size (px)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    # a pool of at most 8 batches of images, cycled: large images for many steps would take
    # longer to make than to train on
    pool = min(args.steps, 8) * args.batch_size
    images = torch.randn(pool, 3, args.size, args.size, generator=g)
    labels = torch.randint(0, 10, (pool,), generator=g)
    loader = torch.utils.data.DataLoader(Cycled(images, labels, args.steps * args.batch_size),
                                         batch_size=args.batch_size, num_workers=args.workers)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"final loss {float(loss.detach()):.4f}")


if __name__ == "__main__":
    main()
