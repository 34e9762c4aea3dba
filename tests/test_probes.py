"""Tests of the built-in probes: registry, options, data, weights and two small models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from detaudit.probes.data import (
    CocoDetection,
    DataSpec,
    ProbeInputError,
    SyntheticDetection,
    collate,
    hflip,
    make_loader,
    parse_data_spec,
)
from detaudit.probes.options import RecipeOptions
from detaudit.probes.recipe import model_kwargs
from PIL import Image
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

from detaudit import probes

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

NAMES = [
    "fasterrcnn",
    "fasterrcnn_mobilenet",
    "fasterrcnn_v2",
    "fcos",
    "keypointrcnn",
    "maskrcnn",
    "maskrcnn_v1",
    "retinanet",
    "retinanet_v2",
    "ssd300",
    "ssdlite",
]
CPU = torch.device("cpu")


def test_registry_lists_every_probe() -> None:
    listed = probes.available()
    assert [name for name, _ in listed] == NAMES
    assert all(summary and "\n" not in summary for _, summary in listed)
    assert callable(probes.get("maskrcnn"))


def test_registry_refuses_duplicates_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="maskrcnn"):
        probes.register("maskrcnn", "again")(probes.get("maskrcnn"))
    with pytest.raises(KeyError, match="fasterrcnn_mobilenet"):
        probes.get("yolo")


def test_options_round_trip_and_unknown_keys() -> None:
    options = RecipeOptions(image_size=96, clip_grad_norm=1.0, augment="flip")
    data = json.loads(json.dumps(options.to_dict()))
    assert RecipeOptions.from_dict(data) == options
    with pytest.raises(ValueError, match="colour, speed"):
        RecipeOptions.from_dict({**data, "speed": 1, "colour": 2})
    with pytest.raises(ValueError, match="augment"):
        RecipeOptions(augment="rotate")


def _items_equal(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_synthetic_is_a_function_of_the_seed() -> None:
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    first = SyntheticDetection(num_images=2, image_size=64, seed=3)
    same = SyntheticDetection(num_images=2, image_size=64, seed=3)
    other = SyntheticDetection(num_images=2, image_size=64, seed=4)
    assert _items_equal(first[1], same[1])
    assert not torch.equal(first[1][0], other[1][0])
    assert not torch.equal(first[0][0], first[1][0])
    # Generation must leave the global RNG streams alone.
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])


def _check_targets(image: torch.Tensor, target: dict, classes: int) -> None:
    size = image.shape[-1]
    boxes, masks, keypoints = target["boxes"], target["masks"], target["keypoints"]
    assert image.dtype == torch.float32 and 0 <= image.min() and image.max() <= 1
    assert boxes.dtype == torch.float32 and masks.dtype == torch.uint8
    assert (boxes[:, 2:] - boxes[:, :2] >= 4).all()
    assert (boxes >= 0).all() and (boxes <= size).all()
    assert target["labels"].dtype == torch.int64
    assert ((target["labels"] >= 1) & (target["labels"] < classes)).all()
    assert keypoints.shape == (len(boxes), 17, 3) and (keypoints[..., 2] == 2).all()
    assert (keypoints[..., 0] >= boxes[:, None, 0]).all()
    assert (keypoints[..., 1] <= boxes[:, None, 3]).all()
    for box, mask in zip(boxes, masks):
        ys, xs = torch.nonzero(mask, as_tuple=True)
        assert len(xs) > 0
        assert box[0] <= xs.min() and xs.max() < box[2]
        assert box[1] <= ys.min() and ys.max() < box[3]


def test_synthetic_targets_are_valid() -> None:
    dataset = SyntheticDetection(num_images=3, image_size=64, instances=5, num_classes=4)
    for image, target in dataset:
        assert image.shape == (3, 64, 64)
        _check_targets(image, target, 4)


def test_dense_item_builds() -> None:
    image, target = SyntheticDetection(num_images=1, image_size=128, instances=1000)[0]
    assert image.shape == (3, 128, 128)
    assert target["boxes"].shape == (1000, 4)
    assert target["masks"].shape == (1000, 128, 128)
    assert (target["area"] > 0).all()


def test_flip_keeps_boxes_masks_and_keypoints_together() -> None:
    image, target = SyntheticDetection(num_images=1, image_size=64, instances=6)[0]
    flipped_image, flipped = hflip(image, target)
    assert torch.equal(flipped_image, image.flip(-1))
    _check_targets(flipped_image, flipped, 5)
    assert torch.equal(hflip(flipped_image, flipped)[1]["boxes"], target["boxes"])
    assert torch.allclose(hflip(flipped_image, flipped)[1]["keypoints"], target["keypoints"])


def test_flip_augmentation_draws_from_the_global_torch_rng() -> None:
    dataset = SyntheticDetection(num_images=1, image_size=64, augment="flip")
    plain = SyntheticDetection(num_images=1, image_size=64)[0]
    outcomes = set()
    for seed in range(8):
        torch.manual_seed(seed)
        flips = torch.rand(1).item() < 0.5
        torch.manual_seed(seed)
        expected = hflip(*plain) if flips else plain
        assert _items_equal(dataset[0], expected)
        outcomes.add(flips)
    assert outcomes == {True, False}


def _write_coco(root: Path, annotations: object) -> tuple[str, str]:
    images = root / "images"
    images.mkdir()
    Image.new("RGB", (200, 100), (255, 0, 0)).save(images / "a.png")
    Image.new("RGB", (64, 64), (0, 255, 0)).save(images / "b.png")
    path = root / "ann.json"
    path.write_text(annotations if isinstance(annotations, str) else json.dumps(annotations))
    return str(images), str(path)


COCO = {
    "images": [
        {"id": 1, "file_name": "a.png"},
        {"id": 2, "file_name": "b.png"},
        {"id": 3, "file_name": "unannotated.png"},
    ],
    "annotations": [
        {
            "image_id": 1,
            "category_id": 7,
            "bbox": [50, 20, 100, 40],
            "segmentation": [[50, 20, 150, 20, 150, 60, 50, 60]],
        },
        {"image_id": 2, "category_id": 3, "bbox": [0, 0, 32, 16]},
        {"image_id": 2, "category_id": 3, "bbox": [1, 1, 5, 5], "iscrowd": 1},
    ],
}


def test_coco_loader_resizes_boxes_and_masks(tmp_path: Path) -> None:
    images, annotations = _write_coco(tmp_path, COCO)
    dataset = CocoDetection(images, annotations, image_size=64)
    assert len(dataset) == 2 and dataset.num_categories == 2
    image, target = dataset[0]
    assert image.shape == (3, 64, 64)
    assert torch.allclose(target["boxes"], torch.tensor([[16.0, 12.8, 48.0, 38.4]]))
    assert target["labels"].tolist() == [2]
    ys, xs = torch.nonzero(target["masks"][0], as_tuple=True)
    assert 15 <= xs.min() <= 17 and 47 <= xs.max() <= 48 and 12 <= ys.min() <= 14
    _, target = dataset[1]
    assert target["boxes"].tolist() == [[0.0, 0.0, 32.0, 16.0]]
    assert target["labels"].tolist() == [1]
    assert int(target["masks"].sum()) == 32 * 16


@pytest.mark.parametrize(
    ("annotations", "message"),
    [("{not json", "not valid JSON"), ({"images": []}, "'annotations'")],
)
def test_coco_loader_rejects_bad_json(tmp_path: Path, annotations: object, message: str) -> None:
    images, path = _write_coco(tmp_path, annotations)
    with pytest.raises(ProbeInputError, match=message) as caught:
        CocoDetection(images, path)
    assert path in str(caught.value)


def test_coco_loader_rejects_missing_files(tmp_path: Path) -> None:
    images, _ = _write_coco(tmp_path, COCO)
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ProbeInputError, match="does not exist") as caught:
        CocoDetection(images, missing)
    assert missing in str(caught.value)
    with pytest.raises(ProbeInputError, match="no-such-dir"):
        CocoDetection(str(tmp_path / "no-such-dir"), missing)


def test_parse_data_spec() -> None:
    assert parse_data_spec(None) == parse_data_spec("synthetic") == DataSpec("synthetic")
    assert parse_data_spec("coco:imgs:a.json") == DataSpec("coco", "imgs", "a.json")
    for bad in ("coco:imgs", "voc:a:b", ""):
        with pytest.raises(ProbeInputError, match="synthetic"):
            parse_data_spec(bad)


def test_loader_batches_and_seeded_shuffle() -> None:
    assert collate([(1, "a"), (2, "b")]) == ([1, 2], ["a", "b"])
    options = RecipeOptions(image_size=32, num_images=6, batch_size=2, shuffle=True, seed=5)
    dataset = SyntheticDetection(num_images=6, image_size=32)

    def order() -> list[int]:
        loader = make_loader(dataset, options)
        return [int(t["image_id"]) for _, targets in loader for t in targets]

    assert order() == order() and sorted(order()) == list(range(6))


def test_weights_load_and_refuse_mismatches(tmp_path: Path) -> None:
    options = RecipeOptions(image_size=96)
    torch.manual_seed(1)
    state = fasterrcnn_mobilenet_v3_large_fpn(**model_kwargs(options)).state_dict()
    good = tmp_path / "good.pt"
    torch.save(state, good)
    torch.manual_seed(2)
    probe = probes.get("fasterrcnn_mobilenet")(CPU, RecipeOptions(image_size=96, weights=str(good)))
    loaded = probe.model.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items())

    missing = str(tmp_path / "absent.pt")
    with pytest.raises(ProbeInputError, match="does not exist") as caught:
        probes.get("fasterrcnn_mobilenet")(CPU, RecipeOptions(image_size=96, weights=missing))
    assert missing in str(caught.value)

    wrong = tmp_path / "wrong.pt"
    torch.save({"head.weight": torch.zeros(1)}, wrong)
    with pytest.raises(ProbeInputError, match=r"missing key\(s\).*1 unexpected") as caught:
        probes.get("fasterrcnn_mobilenet")(CPU, RecipeOptions(image_size=96, weights=str(wrong)))
    assert str(wrong) in str(caught.value)


@pytest.mark.parametrize("name", ["fasterrcnn_mobilenet", "maskrcnn_v1"])
def test_probe_trains_and_evaluates(name: str) -> None:
    torch.manual_seed(0)
    probe = probes.get(name)(CPU, RecipeOptions(image_size=96, num_images=2))
    batch = next(iter(probe.epoch_batches(0)))
    probe.model.train()
    losses = probe.step(probe.model, batch)
    assert isinstance(losses, dict) and losses
    sum(losses.values()).backward()
    assert any(p.grad is not None for p in probe.model.parameters())
    probe.model.eval()
    with torch.no_grad():
        detections = probe.step(probe.model, batch)
    assert isinstance(detections, list) and len(detections) == 1 and "boxes" in detections[0]
