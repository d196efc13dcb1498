"""Data parallelism across Dask workers: one torch.distributed world, DDP per trained model.

    >>> init_world(rank=0, world_size=2, addr="tcp://127.0.0.1:29512")   # doctest: +SKIP
    >>> heads = wrap_ddp(TokenHeads(model), world=(0, 1), device="cpu")   # doctest: +SKIP

Every worker joins one world at set-up (gloo on CPU, NCCL on CUDA), rank =
device index. A model trained on devices ``world`` gets a process group over
exactly those ranks (created in the same order on every rank, as torch
requires) and a ``DistributedDataParallel`` wrapper: gradients are averaged in
buckets during backward, so every replica takes the same optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_GROUPS: dict[tuple[int, ...], object] = {}


def init_world(rank: int, world_size: int, addr: str, groups: list[tuple[int, ...]],
               use_cuda: bool = False) -> None:
    """Join the world and create every data-parallel group (all ranks, same order)."""
    if dist.is_initialized():
        return
    backend = "nccl" if use_cuda and torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=addr, rank=rank, world_size=world_size)
    for g in groups:
        _GROUPS[tuple(g)] = dist.new_group(list(g))


def wrap_ddp(module: torch.nn.Module, world: tuple[int, ...], device: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _GROUPS.get(tuple(world))
    if group is None:
        raise RuntimeError(f"no process group for devices {world}: init_world first")
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    # Buffers (rotary tables) are identical everywhere: do not broadcast them every forward.
    return DDP(module, process_group=group, device_ids=ids, forward_sync_buffers=False)


def shutdown_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUPS.clear()
