"""A DDP training script that starts its own ranks, as users write them: with torchrun
(``--launch torchrun``: it runs ``python -m torch.distributed.run --nproc-per-node 2`` on
itself) or with ``torch.multiprocessing.spawn`` (``--launch spawn``). gloo on CPU, a
DistributedSampler (unless --shared-data), seeded by the script itself. With ``--fsdp`` the
model is sharded by FSDP2 instead of wrapped in DDP, with ``--fsdp1`` by FSDP1
(``FullyShardedDataParallel``, one flat parameter), with ``--tp`` split by tensor
parallelism; in each of those its gradients are clipped. ``--zero``: DDP with a
ZeroRedundancyOptimizer (each rank updates its partition, then broadcasts it).
``--noise-on-rank R``: one rank's first layer adds unseeded noise to its output at step 1.
With torchrun the launching process imports no torch (a thin launcher, cheaper to start)
unless ``--import-torch-first``, as most scripts do: the launcher attached, recording nothing."""

import argparse
import os
import socket
import subprocess
import sys


def _start_torchrun():
    """torchrun started on this script (torchrun's own process imports torch and never
    trains)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *sys.argv], check=False).returncode


if (__name__ == "__main__" and "LOCAL_RANK" not in os.environ and "spawn" not in sys.argv
        and "--import-torch-first" not in sys.argv):
    sys.exit(_start_torchrun())  # (a thin launcher: no torch in this process)

import torch  # (after the launch above)
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def train(rank, world, args):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    sampler = (None if args.shared_data else
               torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, seed=0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler,
                                         shuffle=sampler is None)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if args.fsdp:  # each rank holds a shard of every parameter (FSDP2: DTensors)
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
    elif args.fsdp1:  # each rank holds a shard of one flat parameter of the whole model
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
    elif args.tp:  # each rank holds a slice of each layer, and works on the same batches
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        model = parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        model = DistributedDataParallel(net)
    if args.noise_on_rank == rank:  # unseeded noise in the first layer's output, at step 1
        calls = []

        def noise(module, inputs, output):
            calls.append(None)
            if len(calls) != 2:
                return None
            return output + torch.rand(output.shape, generator=torch.Generator().manual_seed(
                int.from_bytes(os.urandom(4), "little"))) * 1e-3

        net[0].register_forward_hook(noise)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if args.fsdp or args.fsdp1 or args.tp:  # an op on every sharded gradient
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    print(f"rank {rank} trained {args.epochs} epochs", flush=True)


def spawned(rank, world, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    train(rank, world, args)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launch", choices=("torchrun", "spawn"), default="torchrun")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--shared-data", action="store_true", help="no sampler: every rank, all data")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2, not DDP")
    p.add_argument("--fsdp1", action="store_true", help="shard the model with FSDP1, not DDP")
    p.add_argument("--zero", action="store_true", help="a ZeroRedundancyOptimizer (with DDP)")
    p.add_argument("--tp", action="store_true",
                   help="split the model by tensor parallelism (with --shared-data)")
    p.add_argument("--import-torch-first", action="store_true",
                   help="start torchrun after importing torch here, as most scripts do")
    p.add_argument("--noise-on-rank", type=int,
                   help="unseeded noise in the first layer's output on this rank, at step 1")
    args = p.parse_args()
    if args.launch == "spawn":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(spawned, args=(2, port, args), nprocs=2)
    elif "LOCAL_RANK" not in os.environ:  # --import-torch-first: torch is loaded here
        sys.exit(_start_torchrun())
    else:  # a rank torchrun started
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
