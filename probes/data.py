"""Datasets for the built-in probes: seeded synthetic scenes and COCO-format folders."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from ..seeding import seeded_loader_kwargs
from .options import RecipeOptions

Target = dict[str, torch.Tensor]
Sample = tuple[torch.Tensor, Target]

NUM_KEYPOINTS = 17
# COCO person keypoint order: a horizontal flip swaps every left point with its right twin.
KEYPOINT_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
MIN_BOX = 4
DATA_SPEC_HELP = "use 'synthetic' or 'coco:IMAGES_DIR:ANNOTATIONS.json'"


class ProbeInputError(ValueError):
    """A data or weights file that the recipe cannot use."""


def hflip(image: torch.Tensor, target: Target) -> Sample:
    """Mirror an image and its boxes, masks and keypoints left to right."""
    width = image.shape[-1]
    boxes = target["boxes"]
    keypoints = target["keypoints"][:, KEYPOINT_FLIP].clone()
    keypoints[..., 0] = width - keypoints[..., 0]
    keypoints[keypoints[..., 2] == 0] = 0  # unlabelled points stay at the origin
    flipped = dict(target)
    flipped["boxes"] = torch.stack(
        [width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1
    )
    flipped["masks"] = target["masks"].flip(-1)
    flipped["keypoints"] = keypoints
    return image.flip(-1), flipped


class DetectionDataset(Dataset):
    """Shared `__getitem__`: load one sample, then apply the optional flip augmentation."""

    augment: str
    num_categories: int

    def load(self, index: int) -> Sample:
        """The un-augmented sample at `index`."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> Sample:
        """The sample at `index`, flipped with probability 1/2 when augment is "flip"."""
        image, target = self.load(index)
        # The global torch RNG on purpose: user recipes draw augmentations this way, and the
        # audit follows that stream.
        if self.augment == "flip" and torch.rand(1).item() < 0.5:
            return hflip(image, target)
        return image, target


def class_colours(num_classes: int) -> np.ndarray:
    """One RGB colour per class, float32 [num_classes, 3]."""
    # A fixed local generator: every seed shows the model the same colour-to-class task.
    return np.random.default_rng(0).uniform(0.2, 1.0, size=(num_classes, 3)).astype(np.float32)


class SyntheticDetection(DetectionDataset):
    """Images of coloured boxes and ellipses, each item a pure function of (seed, index)."""

    def __init__(
        self,
        num_images: int = 4,
        image_size: int = 128,
        instances: int = 3,
        num_classes: int = 5,
        seed: int = 0,
        augment: str = "none",
    ) -> None:
        self.num_images = num_images
        self.image_size = image_size
        self.instances = instances
        self.num_classes = num_classes
        self.seed = seed
        self.augment = augment
        self.num_categories = num_classes - 1
        self.colours = class_colours(num_classes)

    def __len__(self) -> int:
        """The number of images."""
        return self.num_images

    def load(self, index: int) -> Sample:
        """Draw image `index`; its own generator keeps the global RNGs untouched."""
        if not 0 <= index < self.num_images:
            raise IndexError(f"index {index} out of range for {self.num_images} images")
        size, count = self.image_size, self.instances
        rng = np.random.default_rng((self.seed, index))
        wh = rng.integers(MIN_BOX, max(MIN_BOX, size // 2), size=(count, 2), endpoint=True)
        x1, y1 = rng.integers(0, size - wh, endpoint=True).T
        w, h = wh.T
        x2, y2 = x1 + w, y1 + h
        labels = rng.integers(1, self.num_classes, size=count)
        ellipse = rng.random(count) < 0.5
        keypoints = np.empty((count, NUM_KEYPOINTS, 3), dtype=np.float32)
        keypoints[..., 0] = x1[:, None] + rng.random((count, NUM_KEYPOINTS)) * w[:, None]
        keypoints[..., 1] = y1[:, None] + rng.random((count, NUM_KEYPOINTS)) * h[:, None]
        keypoints[..., 2] = 2
        noise = rng.random((3, size, size), dtype=np.float32)

        pixels = np.arange(size)
        in_x = (pixels >= x1[:, None]) & (pixels < x2[:, None])
        in_y = (pixels >= y1[:, None]) & (pixels < y2[:, None])
        masks = in_y[:, :, None] & in_x[:, None, :]
        chosen = np.flatnonzero(ellipse)
        if chosen.size:
            centres = pixels.astype(np.float32) + 0.5
            ex = (centres - (x1[chosen, None] + w[chosen, None] / 2)) / (w[chosen, None] / 2)
            ey = (centres - (y1[chosen, None] + h[chosen, None] / 2)) / (h[chosen, None] / 2)
            masks[chosen] = (ey[:, :, None] ** 2 + ex[:, None, :] ** 2) <= 1

        # Later instances are painted over earlier ones: find the last one covering each pixel.
        covered = masks.any(axis=0)
        top = count - 1 - masks[::-1].argmax(axis=0)
        colour = self.colours[labels[top]].transpose(2, 0, 1)
        image = np.where(covered, 0.8 * colour + 0.2 * noise, 0.25 * noise).astype(np.float32)

        target = {
            "boxes": torch.from_numpy(np.stack([x1, y1, x2, y2], axis=1).astype(np.float32)),
            "labels": torch.from_numpy(labels.astype(np.int64)),
            "masks": torch.from_numpy(masks.astype(np.uint8)),
            "keypoints": torch.from_numpy(keypoints),
            "image_id": torch.tensor(index, dtype=torch.int64),
            "area": torch.from_numpy(masks.sum(axis=(1, 2)).astype(np.float32)),
            "iscrowd": torch.zeros(count, dtype=torch.int64),
        }
        return torch.from_numpy(image), target


def _read_annotations(path: str) -> dict[str, Any]:
    """The checked contents of a COCO annotations file."""
    if not os.path.isfile(path):
        raise ProbeInputError(f"COCO annotations file {path} does not exist.")
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except json.JSONDecodeError as error:
        raise ProbeInputError(
            f"COCO annotations file {path} is not valid JSON ({error.msg} at line {error.lineno})."
        ) from error
    except (OSError, UnicodeDecodeError) as error:
        raise ProbeInputError(f"COCO annotations file {path} cannot be read ({error}).") from error
    if not isinstance(data, dict):
        raise ProbeInputError(f"COCO annotations file {path} does not hold a JSON object.")
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise ProbeInputError(f"COCO annotations file {path} has no '{key}' list.")
    for kind, items, required in (
        ("image", data["images"], ("id", "file_name")),
        ("annotation", data["annotations"], ("image_id", "bbox", "category_id")),
        ("category", data.get("categories", []), ("id",)),
    ):
        for item in items:
            missing = [key for key in required if not isinstance(item, dict) or key not in item]
            if missing:
                raise ProbeInputError(
                    f"COCO annotations file {path} has an {kind} without '{missing[0]}'."
                )
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    fields = (
        ("images", "id", lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
         "an integer or a string"),
        ("images", "file_name", lambda v: isinstance(v, str) and v != "", "a file name"),
        ("annotations", "image_id", lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
         "an integer or a string"),
        ("annotations", "category_id",
         lambda v: isinstance(v, (int, str)) and not isinstance(v, bool), "an integer or a string"),
        ("annotations", "bbox", lambda v: isinstance(v, list) and len(v) == 4
         and all(number(x) for x in v), "[x, y, width, height] numbers"),
        ("annotations", "iscrowd", lambda v: v is None or number(v), "0 or 1"),
        ("categories", "id", lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
         "an integer or a string"),
    )
    for key, name, ok, expected in fields:
        for index, item in enumerate(data.get(key, [])):
            if name in item and not ok(item[name]):
                raise ProbeInputError(
                    f"COCO annotations file {path}: {key}[{index}].{name} is "
                    f"{item[name]!r:.60}, not {expected}."
                )
    return data


def _polygon_mask(segmentation: Any, scale: tuple[float, float], size: int) -> np.ndarray | None:
    """The mask of a COCO polygon list at the resized scale, or None if it is not polygons."""
    if not (isinstance(segmentation, list) and segmentation):
        return None
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    for polygon in segmentation:
        if not (isinstance(polygon, list) and len(polygon) >= 6):
            return None
        points = [(x * scale[0], y * scale[1]) for x, y in zip(polygon[0::2], polygon[1::2])]
        draw.polygon(points, fill=1)
    return np.asarray(canvas, dtype=np.uint8)


class CocoDetection(DetectionDataset):
    """A COCO-format folder, resized to `image_size` square; images without objects are skipped."""

    def __init__(
        self, images_dir: str, annotations: str, image_size: int = 128, augment: str = "none"
    ) -> None:
        if not os.path.isdir(images_dir):
            raise ProbeInputError(f"COCO images folder {images_dir} does not exist.")
        data = _read_annotations(annotations)
        category_ids = {c["id"] for c in data.get("categories", [])}
        category_ids |= {a["category_id"] for a in data["annotations"]}
        # Contiguous labels 1..K whatever the file's category ids are.
        self.labels = {cid: rank + 1 for rank, cid in enumerate(sorted(category_ids))}
        self.num_categories = len(self.labels)
        self.image_size = image_size
        self.augment = augment
        by_image: dict[Any, list[dict[str, Any]]] = {}
        for ann in data["annotations"]:
            # Crowd regions and empty boxes are not training targets (as in torchvision's recipe).
            if not ann.get("iscrowd", 0) and ann["bbox"][2] > 0 and ann["bbox"][3] > 0:
                by_image.setdefault(ann["image_id"], []).append(ann)
        self.samples: list[tuple[Any, str, list[dict[str, Any]]]] = []
        for image in data["images"]:
            if image["id"] not in by_image:
                continue
            path = os.path.join(images_dir, image["file_name"])
            if not os.path.isfile(path):
                raise ProbeInputError(f"COCO image {path} listed in {annotations} does not exist.")
            self.samples.append((image["id"], path, by_image[image["id"]]))
        if not self.samples:
            raise ProbeInputError(f"COCO annotations file {annotations} has no annotated image.")

    def __len__(self) -> int:
        """The number of annotated images."""
        return len(self.samples)

    def load(self, index: int) -> Sample:
        """Read, resize and convert image `index` and its annotations."""
        image_id, path, anns = self.samples[index]
        size = self.image_size
        try:
            with Image.open(path) as opened:
                width, height = opened.size
                pixels = opened.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        except OSError as error:
            raise ProbeInputError(f"COCO image {path} cannot be read ({error}).") from error
        sx, sy = size / width, size / height
        scale = np.array([sx, sy, sx, sy], dtype=np.float32)
        xywh = np.array([a["bbox"] for a in anns], dtype=np.float32)
        boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1) * scale
        boxes = boxes.clip(0, size)
        masks = np.zeros((len(anns), size, size), dtype=np.uint8)
        keypoints = np.zeros((len(anns), NUM_KEYPOINTS, 3), dtype=np.float32)
        for i, ann in enumerate(anns):
            polygon = _polygon_mask(ann.get("segmentation"), (sx, sy), size)
            if polygon is None:  # RLE or no segmentation: fall back to the box
                x1, y1, x2, y2 = boxes[i]
                masks[i, int(y1) : int(np.ceil(y2)), int(x1) : int(np.ceil(x2))] = 1
            else:
                masks[i] = polygon
            points = ann.get("keypoints")
            if isinstance(points, list) and len(points) == NUM_KEYPOINTS * 3:
                keypoints[i] = np.array(points, dtype=np.float32).reshape(NUM_KEYPOINTS, 3)
        keypoints[..., 0] *= sx
        keypoints[..., 1] *= sy
        keypoints[keypoints[..., 2] == 0] = 0
        labels = np.array([self.labels[a["category_id"]] for a in anns], dtype=np.int64)
        area = np.array([a.get("area", a["bbox"][2] * a["bbox"][3]) for a in anns], np.float32)
        # Clipping can empty a box that lay outside the image; such a box is no target.
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        image = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 255).permute(2, 0, 1)
        target = {
            "boxes": torch.from_numpy(boxes[keep]),
            "labels": torch.from_numpy(labels[keep]),
            "masks": torch.from_numpy(masks[keep]),
            "keypoints": torch.from_numpy(keypoints[keep]),
            "image_id": torch.tensor(image_id, dtype=torch.int64),
            "area": torch.from_numpy(area[keep] * np.float32(sx * sy)),
            "iscrowd": torch.zeros(int(keep.sum()), dtype=torch.int64),
        }
        return image.contiguous(), target


@dataclass(frozen=True)
class DataSpec:
    """Where the recipe's images come from."""

    kind: str
    images: str | None = None
    annotations: str | None = None


def parse_data_spec(spec: str | None) -> DataSpec:
    """Parse None, "synthetic" or "coco:IMAGES_DIR:ANNOTATIONS.json"."""
    if spec is None or spec == "synthetic":
        return DataSpec("synthetic")
    kind, _, rest = spec.partition(":")
    images, _, annotations = rest.partition(":")
    if kind != "coco" or not images or not annotations:
        raise ProbeInputError(f"data spec {spec!r} is not understood; {DATA_SPEC_HELP}.")
    return DataSpec("coco", images, annotations)


def make_dataset(options: RecipeOptions) -> DetectionDataset:
    """The dataset the options ask for."""
    spec = parse_data_spec(options.data)
    if spec.kind == "coco":
        return CocoDetection(spec.images, spec.annotations, options.image_size, options.augment)
    return SyntheticDetection(
        options.num_images,
        options.image_size,
        options.instances,
        options.num_classes,
        options.seed,
        options.augment,
    )


def collate(batch: list[Sample]) -> tuple[list[torch.Tensor], list[Target]]:
    """Keep images and targets as lists: detectors take images of different sizes."""
    return [image for image, _ in batch], [target for _, target in batch]


def make_loader(dataset: Dataset, options: RecipeOptions) -> DataLoader:
    """A DataLoader over `dataset` with the options' batching, shuffling and workers."""
    return DataLoader(
        dataset,
        batch_size=options.batch_size,
        shuffle=options.shuffle,
        num_workers=options.workers,
        collate_fn=collate,
        persistent_workers=False,
        **seeded_loader_kwargs(options.seed),
    )
