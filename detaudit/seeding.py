"""Seeding every RNG the way a reproducible training script should.

torch is imported where it is used: ``from detaudit import seed_everything`` before ``import
torch``, in a script that ``detaudit exec`` runs, leaves torch's import to the script (the
recording attaches as torch loads, and needs this module whole).
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def seed_everything(seed: int, workers: bool = False) -> None:
    """Seed python `random`, numpy's global RNG, torch CPU and every CUDA device.

    With `workers`, also export ``PYTHONHASHSEED`` (unless already set) so that processes
    started from here -- spawned DataLoader workers, subprocesses -- hash strings the same
    way every run; the current process's hash seed is fixed at its start and cannot be
    changed. Pass :func:`seeded_loader_kwargs` to each DataLoader so that its shuffling and
    each worker's numpy / ``random`` streams are seeded too (distinct per rank).
    """
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if workers:
        os.environ.setdefault("PYTHONHASHSEED", str(seed))


def seed_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: derive numpy and python seeds from the worker's torch seed.

    PyTorch seeds each worker's torch RNG with base_seed + worker_id, but leaves numpy and
    `random` as forked copies, so every worker would draw the same augmentations.
    """
    import torch

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def loader_generator(seed: int, rank: int = 0) -> torch.Generator:
    """A generator for a DataLoader's shuffling and worker base seeds, distinct per rank."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed + 1_000_003 * rank)
    return generator


def seeded_loader_kwargs(seed: int, rank: int = 0) -> dict[str, Any]:
    """The DataLoader arguments that make shuffling and workers reproducible."""
    return {"generator": loader_generator(seed, rank), "worker_init_fn": seed_worker}
