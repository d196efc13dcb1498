"""Trainer -> vLLM weights through torch.distributed collectives: bucketed, in the dtype.

    >>> plan = bucket_plan([("model.norm.weight", "float32", (64,)),
    ...                     ("lm_head.weight", "bfloat16", (259, 64))], bucket_bytes=1024)
    >>> [[n for n, _, _ in b] for b in plan]
    [['model.norm.weight'], ['lm_head.weight']]
    >>> bucket_bytes(plan[1])                       # bf16 stays two bytes a value
    33152

vLLM's documented weight-update path: a process group shared by the trainer and the
engine's workers (a worker extension joins it, :mod:`backends.vllm_backend.worker_ext`),
made here from a ``TCPStore`` rendezvous without touching either side's default
``torch.distributed`` world (gloo on CPU, NCCL on GPU). Rank 0 is the trainer's first
rank; ranks 1.. are the workers of each engine, tensor-parallel rank order within an
engine. The group is made once per run and model, at the first update, and kept.

One update: rank 0 broadcasts the bucket plan (vLLM names, dtypes and full shapes of
everything, as JSON bytes), then each bucket as one flat byte buffer, the tensors in
the trainer's parameter dtype, each aligned so any dtype can view it. The trainer's
layout is undone on the way out and the engine's made on the way in: a parameter split
over the trainer's ranks (tensor or fully sharded data parallel, a DTensor) is gathered
whole (``full_tensor``: every rank holding a piece takes part, :func:`gather`; they are
all senders, ``rpeg.cost.engine_sync.sync_senders``), and each engine worker loads the
whole tensor with its model's own loader, which keeps the worker's tensor-parallel shard.
An engine sharing a device with a sender is not in the group (two ranks of one group on
one GPU: NCCL refuses it): that sender hands it each bucket in process (:func:`send`'s
``loads``; through CUDA IPC handles on a GPU, ``worker_ext``). Nothing goes through Dask,
the client, or disk.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator
from typing import Any

from rpeg.runtime.dask.devices import COLLECTIVE_TIMEOUT_S

ALIGN = 16                      # bytes: every tensor of a bucket starts at a multiple
_PREFIX = "rpeg-weights/"

Meta = tuple[str, str, tuple[int, ...]]      # (vLLM name, dtype name, full shape)


def open_group(addr: str, rank: int, world: int, device: str = "cpu",
               timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """A process group of ``world`` ranks met at ``addr`` (``tcp://host:port``; rank 0
    serves the store): NCCL when ``device`` is a GPU, else gloo. Blocks until all joined."""
    import torch
    import torch.distributed as dist

    from backends.torch_backend.distributed import rendezvous_store

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(_PREFIX, rendezvous_store(addr, rank, world, timeout,
                                                       wait_for_workers=False))
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, timeout)
    broadcast(group, torch.zeros(1, device=device))          # all ranks are in
    return group


def broadcast(group, tensor, root: int = 0) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    group.broadcast([tensor], opts).wait()


# --- what goes where ----------------------------------------------------------------------

def _itemsize(dtype: str) -> int:
    import torch
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _nbytes(meta: Meta) -> int:
    n = 1
    for d in meta[2]:
        n *= int(d)
    return n * _itemsize(meta[1])


def _padded(n: int) -> int:
    return n + (-n % ALIGN)


def bucket_plan(metas: Iterable[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """Tensors grouped in order into buckets of at most ``bucket_bytes`` (a larger tensor
    alone in its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    out: list[list[Meta]] = []
    size = 0
    for m in metas:
        n = _padded(_nbytes(m))
        if not out or (out[-1] and size + n > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append(m)
        size += n
    return out


def bucket_bytes(bucket: list[Meta]) -> int:
    """Bytes of one bucket's flat buffer, alignment included."""
    return sum(_padded(_nbytes(m)) for m in bucket)


def trainer_metas(state: dict[str, Any]) -> list[Meta]:
    """(vLLM name, dtype, full shape) of every parameter the engine loads, from a trainer's
    ``state_dict`` (a DTensor reports its full shape without gathering)."""
    from backends.vllm_backend.weights import vllm_name
    out = []
    for name, t in state.items():
        target = vllm_name(name)
        if target is not None:
            out.append((target, str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape)))
    return out


# --- the trainer's side --------------------------------------------------------------------

def gather(state: dict[str, Any], plan: list[list[Meta]]) -> Iterator[list[Any]]:
    """Each bucket's tensors whole, in plan order: a split parameter is gathered from every
    rank holding a piece (a collective each of those ranks runs in the same order)."""
    from backends.vllm_backend.weights import vllm_name
    by_target = {vllm_name(k): k for k in state}
    for bucket in plan:
        out = []
        for target, _, _ in bucket:
            t = state[by_target[target]]
            full = getattr(t, "full_tensor", None)
            out.append((full() if callable(full) else t).detach())
        yield out


def send(group, state: dict[str, Any], bucket_size: int, device: str = "cpu",
         loads=()) -> tuple[int, int]:
    """A sender's part of one update, every sender in the same order: gather each bucket
    whole (the trainer's ranks holding pieces together), broadcast it over ``group`` (the
    first sender; None elsewhere, or when no engine is in the group) after the plan, and
    hand it to each of ``loads`` (``load(names, tensors)``: an engine on this device,
    loaded in process). Returns (buckets, bytes)."""
    import torch

    plan = bucket_plan(trainer_metas(state), bucket_size)
    if group is not None:
        header = json.dumps([[[n, d, list(s)] for n, d, s in b] for b in plan]).encode()
        broadcast(group, torch.tensor([len(header)], dtype=torch.int64, device=device))
        broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
    total = 0
    for bucket, tensors in zip(plan, gather(state, plan), strict=True):
        if group is not None:
            flat = pack(tensors, device)
            broadcast(group, flat)
        for load in loads:
            load([n for n, _, _ in bucket], tensors)
        total += bucket_bytes(bucket)
    return len(plan), total


def pack(tensors: list, device: str = "cpu"):
    """Tensors as one flat byte buffer, each at an aligned offset (dtype kept)."""
    import torch

    parts = []
    for t in tensors:
        raw = t.to(device).contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, torch.zeros(-raw.numel() % ALIGN, dtype=torch.uint8, device=device)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


# --- the engine's side ---------------------------------------------------------------------

def receive(group, device: str = "cpu") -> Iterator[tuple[list[str], list[Any]]]:
    """Every bucket rank 0 sends: (vLLM names, tensors viewing the received buffer)."""
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=device)
    broadcast(group, size)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(group, raw)
    plan = [[(n, d, tuple(s)) for n, d, s in b] for b in json.loads(bytes(raw.cpu().numpy()))]
    for bucket in plan:
        flat = torch.empty(bucket_bytes(bucket), dtype=torch.uint8, device=device)
        broadcast(group, flat)
        yield [n for n, _, _ in bucket], unpack(bucket, flat)


def unpack(bucket: list[Meta], flat) -> list:
    import torch

    out, offset = [], 0
    for _, dtype, shape in bucket:
        n = _nbytes((_, dtype, shape))
        out.append(flat[offset:offset + n].view(getattr(torch, dtype)).reshape(shape))
        offset += _padded(n)
    return out

