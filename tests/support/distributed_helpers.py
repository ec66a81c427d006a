"""Two gloo ranks on one CPU machine, for the distributed tests (DDP, FSDP2, tensor parallelism)."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, port: int) -> None:
    """Join the process group of :func:`spawn` (one intra-op thread per rank)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` on :data:`WORLD` processes and wait for them."""
    mp.spawn(fn, args=(free_port(), *args), nprocs=WORLD, join=True)


def bits(tensors) -> torch.Tensor:
    """The float64 bit patterns of ``tensors``, concatenated: equal exactly when every value is."""
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]).view(torch.int64)
