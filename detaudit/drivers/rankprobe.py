"""One rank's probe: wrapped in DDP, its data sharded, its data pipeline watched.

What the cross-rank checks need beyond the trace is gathered here and stored in the
trace (``trace.probe["distributed"]``): the parameters as built (before DDP's broadcast
hides any difference), each epoch's sampler indices, and whether loading a batch drew from
a global RNG, with that RNG's state before the draw. Watching never draws from an RNG.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from ..errors import DetauditError
from ..probe import Probe
from ..record.fingerprint import Fingerprinter, fingerprint_bytes
from ..record.recorder import rng_states
from ..seeding import loader_generator, seed_everything
from ..trace import PROBE_DISTRIBUTED, Trace

RANK_SEED_STRIDE = 1_000_003  # as in seeding.loader_generator


def is_rank_aware(fn: Callable[..., Any]) -> bool:
    """Whether a probe function takes ``(device, rank, world_size)``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


class RankWatch:
    """What one rank's data pipeline and initialisation looked like in one repeat."""

    def __init__(self, rank: int, world_size: int, backend: str) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.wrapped_by = "detaudit"
        self.init: dict[str, str] | None = None
        self.epochs: list[dict[str, Any]] = []
        self.fetches: list[dict[str, Any]] = []
        self.sharded: list[str] = []  # parameters each rank holds its own shard of (FSDP2)
        self.tensor_parallel = False  # ranks split the model: a group shares its batches
        self.partial_grads: list[str] = []  # parameters whose gradients are partial sums

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the trace."""
        return {
            "rank": self.rank, "world_size": self.world_size, "backend": self.backend,
            "wrapped_by": self.wrapped_by, "init": self.init, "epochs": self.epochs,
            "fetches": self.fetches, "sharded": self.sharded,
            "tensor_parallel": self.tensor_parallel, "partial_grads": self.partial_grads,
        }

    def note_in(self, trace: Trace) -> None:
        """Put what this rank noted into its trace's probe (the cross-rank checks read it)."""
        trace.probe[PROBE_DISTRIBUTED] = self.to_dict()

    def record_init(self, model: torch.nn.Module) -> None:
        """Fingerprints of the parameters as built, named as inside the DDP wrapper."""
        fingerprinter = Fingerprinter(stats=False)
        params = list(model.named_parameters())
        for _, param in params:
            fingerprinter.add(param)
        prints = fingerprinter.collect()
        self.init = {f"module.{name}": p.fp for (name, _), p in zip(params, prints)}

    def watch(self, probe: Probe) -> Callable[[int], Iterable[Any]]:
        """`probe`'s batches as a callable `epoch -> iterable` that records what it loads."""
        source = dataclasses.replace(probe)  # keeps the batches it had before they are replaced
        return lambda epoch: _WatchedEpoch(self, epoch, source.epoch_batches(epoch))


class _WatchedEpoch:
    """One epoch's batches; notes the sampler's indices and the RNG draws of each fetch."""

    def __init__(self, watch: RankWatch, epoch: int, batches: Iterable[Any]) -> None:
        self.watch, self.epoch, self.batches = watch, epoch, batches

    def __iter__(self) -> Iterator[Any]:
        self.watch.epochs.append({"epoch": self.epoch, "sampler": sampler_snapshot(self.batches)})
        iterator = iter(self.batches)
        index = 0
        while True:
            before = _rng_prints()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            after = _rng_prints()
            drew = sorted(name for name in before if before[name] != after.get(name))
            self.watch.fetches.append(
                {"epoch": self.epoch, "index": index, "before": before, "drew": drew}
            )
            yield batch
            index += 1


def _rng_prints() -> dict[str, str]:
    """Every global RNG's state, the rank's own CUDA device's generator named ``cuda`` so
    that rank 0's cuda:0 is compared with rank 1's cuda:1."""
    own = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else None
    return {("cuda" if name == own else name): fingerprint_bytes(state)
            for name, state in rng_states().items()}


def sampler_snapshot(batches: Iterable[Any]) -> dict[str, Any] | None:
    """The index order of a DataLoader's sampler, where listing it draws no randomness."""
    if not isinstance(batches, DataLoader):
        return None
    sampler = batches.batch_sampler
    # (a BatchSampler subclass may hold no sampler: accelerate's BatchSamplerShard)
    sampler = getattr(sampler, "sampler", None) if isinstance(sampler, BatchSampler) else None
    if isinstance(sampler, DistributedSampler):
        return {
            "kind": "DistributedSampler", "epoch": sampler.epoch, "shuffle": sampler.shuffle,
            "num_replicas": sampler.num_replicas, "rank": sampler.rank, "seed": sampler.seed,
            "padding": max(0, sampler.total_size - len(sampler.dataset)),
            "indices": [int(i) for i in sampler],
        }
    if isinstance(sampler, SequentialSampler):
        return {"kind": "SequentialSampler", "shuffle": False, "padding": 0,
                "indices": list(range(len(sampler)))}
    return None


def prepare_rank_probe(
    probe: Probe, device: torch.device, watch: RankWatch, seed: int, rank_aware: bool
) -> Probe:
    """Wrap the probe's model in DDP (unless the probe did) and watch its data.

    A single-process probe (``probe(device)``) is distributed here: its DataLoader is
    rebuilt over a DistributedSampler (``set_epoch`` every epoch) and, once the model is
    built from the common seed, every RNG is re-seeded per rank so augmentations differ.
    """
    if not isinstance(probe, Probe):
        return probe  # run_repeat reports what it got instead
    if isinstance(probe.model, DistributedDataParallel):
        watch.wrapped_by = "probe"
    else:
        watch.record_init(probe.model)
        device_ids = [device.index] if device.type == "cuda" else None
        probe.model = DistributedDataParallel(probe.model, device_ids=device_ids)
    if not rank_aware:
        probe.batches = shard_loader(probe.batches, watch.rank, watch.world_size, seed)
        seed_everything(seed + RANK_SEED_STRIDE * watch.rank)
    probe.batches = watch.watch(probe)
    return probe


def shard_loader(
    batches: Any, rank: int, world_size: int, seed: int
) -> Callable[[int], DataLoader]:
    """A DataLoader's dataset re-batched over a DistributedSampler, as `epoch -> loader`."""
    if not isinstance(batches, DataLoader) or batches.batch_size is None:
        raise DetauditError(
            "with --nproc, a probe(device) must return a DataLoader with a batch_size as batches; "
            "write probe(device, rank, world_size) to shard the data yourself"
        )
    shuffle = not isinstance(batches.batch_sampler.sampler, SequentialSampler)
    sampler = DistributedSampler(
        batches.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
    )
    loader = DataLoader(
        batches.dataset, batch_size=batches.batch_size, sampler=sampler,
        num_workers=batches.num_workers, collate_fn=batches.collate_fn,
        pin_memory=batches.pin_memory, drop_last=batches.drop_last,
        worker_init_fn=batches.worker_init_fn, generator=loader_generator(seed, rank),
    )

    def epoch_loader(epoch: int) -> DataLoader:
        sampler.set_epoch(epoch)
        return loader

    return epoch_loader
