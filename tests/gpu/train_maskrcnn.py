"""A tutorial-style Mask R-CNN training script (one class, many instances per image), written
as users write them, for `detaudit exec` on a GPU:

    detaudit exec --seed 0 --max-steps 3 -- python tests/gpu/train_maskrcnn.py
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2


class Blobs(Dataset):
    """Images with `instances` square objects of one class, their boxes and masks."""

    def __init__(self, images: int, size: int, instances: int) -> None:
        self.images, self.size, self.instances = images, size, instances

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        image = torch.rand(3, self.size, self.size, generator=g)
        xy = torch.randint(0, self.size - 24, (self.instances, 2), generator=g).float()
        wh = torch.randint(8, 24, (self.instances, 2), generator=g).float()
        boxes = torch.cat([xy, xy + wh], dim=1)
        masks = torch.zeros(self.instances, self.size, self.size, dtype=torch.uint8)
        for k, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        labels = torch.ones(self.instances, dtype=torch.int64)
        return image, {"boxes": boxes, "labels": labels, "masks": masks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--instances", type=int, default=300)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    data = DataLoader(Blobs(args.images, args.size, args.instances), batch_size=args.batch_size,
                      shuffle=True, num_workers=2, collate_fn=lambda b: tuple(zip(*b)))
    model = maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None, num_classes=2,
                                     min_size=args.size, max_size=args.size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=5e-4)
    for epoch in range(args.epochs):
        model.train()
        for images, targets in data:
            images = [im.to(device) for im in images]
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            losses = model(images, targets)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
