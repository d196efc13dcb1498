"""Weights moved between layouts: a trainer's new version into the copies that read it.

    >>> plan = bucket_plan([("a", (1024, 1024)), ("b", (4,)), ("c", (2048, 1024))],
    ...                    bytes_per_value=4, bucket_bytes=4 << 20)
    >>> [[name for name, _ in b] for b in plan]
    [['a', 'b'], ['c']]

One transfer per (model, version) is a collective over every device it concerns (the op
calls' ``gang``), in the parameter dtype of the readers, in buckets of about
``BUCKET_BYTES``:

1. the *sources* — the trainer's devices that hold its weights: its first tensor-parallel
   block, or every home device when ZeRO-3 shards the weights — make each parameter of the
   bucket whole (``DTensor.full_tensor``: an all-gather over the shards' mesh; nothing
   for weights already whole);
2. the first source broadcasts the bucket, flat, to every device that is not a source
   (NCCL on GPUs, gloo on CPUs);
3. each device copies the bucket's tensors into its copies that load this version
   (``fills``), each keeping its own slice when it is split another way.

A device runs its part once, whichever of its calls of the transfer comes first. In one
process (``rpeg.runtime.calibrate.inline``: no process group) the loading copy reads the source
replica directly.
"""

from __future__ import annotations

import torch

BUCKET_BYTES = 64 << 20


def bucket_plan(shapes, bytes_per_value: int, bucket_bytes: int = BUCKET_BYTES):
    """``[(name, shape)]`` cut into consecutive buckets of about ``bucket_bytes``."""
    out, cur, size = [], [], 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        cur.append((name, tuple(shape)))
        size += n * bytes_per_value
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter under its ``state_dict`` name (tied ones under each name) as the
    module holds it now: whole, or a DTensor (tensor-parallel, FSDP2 shards)."""
    return list(model.named_parameters(remove_duplicate=False))


def sent_weights(replica) -> list[tuple[str, torch.Tensor]]:
    """What a transfer moves of ``replica``: every parameter, or a LoRA model's adapters
    alone (its frozen backbone never changes)."""
    own = named_weights(replica.model)
    if getattr(replica, "lora", None) is None:
        return own
    from backends.torch_backend.lora import adapter_names
    keep = set(adapter_names(replica.model))
    return [(k, v) for k, v in own if k in keep]


def gather_refusal(tensors, takers) -> str | None:
    """Why gathering ``tensors`` (name, tensor) whole on the devices ``takers`` would hang:
    a tensor split over a device that takes no part never completes its gather (that rank
    never enters it). None when every piece's holder takes part (ranks are devices)."""
    takers = set(takers)
    for name, t in tensors:
        mesh = getattr(t, "device_mesh", None)
        if mesh is None:
            continue
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        missing = [r for r in ranks if r not in takers]
        if missing:
            return (f"'{name}' is split over devices {ranks}, and devices {missing} take no "
                    "part in the weight sync, so its gather would wait for them forever")
    return None


def check_gather(tensors, takers) -> None:
    """Refuse (before any collective) a gather that :func:`gather_refusal` says would hang."""
    why = gather_refusal(tensors, takers)
    if why:
        from rpeg.errors import BackendError
        raise BackendError(f"a weight sync must be run by every device holding a piece of the "
                           f"weights, and {why}",
                           hint="the senders are the trainer's first tensor-parallel block, or "
                                "all its devices under ZeRO-3 (rpeg.cost.engine_sync.sync_senders)")


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor made whole: a DTensor gathered over its mesh (a collective), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def transfer(call, replicas: dict, device: str, dtype: torch.dtype, peers=None) -> None:
    """This device's part of the weight transfer ``call`` belongs to (see the module doc)."""
    import torch.distributed as dist

    from backends.torch_backend.distributed import group_of, load_full
    from rpeg.runtime.lowering.context import transfer_group
    from rpeg.runtime.lowering.instances import base_of

    me = call.device
    loading = [replicas[c] for c in call.fills]
    targets = [r.model for r in loading]
    if not dist.is_initialized():                      # one process: read the source directly
        source = (peers or {}).get(call.sources[0])
        home = (source.replicas if source is not None else replicas)[base_of(call.model)]
        with torch.no_grad():
            for model in targets:
                load_full(model, ((k, whole(v).detach().to(dtype))
                                  for k, v in sent_weights(home)))
        return
    home = replicas[base_of(call.model)] if me in call.sources else None
    own = sent_weights(home if home is not None else loading[0])
    if home is not None:
        check_gather(own, call.sources)
    params = dict(own)
    shapes = [(k, tuple(v.shape)) for k, v in own]
    size = torch.empty((), dtype=dtype).element_size()
    bcast = transfer_group(call)
    group = group_of(bcast) if me in bcast else None
    for bucket in bucket_plan(shapes, size):
        full = None
        if home is not None:
            full = [whole(params[k]).detach().to(device=device, dtype=dtype) for k, _ in bucket]
        if group is not None:
            if me == call.sources[0]:
                flat = torch.cat([t.reshape(-1) for t in full])
            else:
                flat = torch.empty(sum(_numel(s) for _, s in bucket), dtype=dtype,
                                   device=device)
            dist.broadcast(flat.view(torch.uint8), src=call.sources[0], group=group)
            if full is None:
                full = list(torch.split(flat, [_numel(s) for _, s in bucket]))
        if targets:
            with torch.no_grad():
                for model in targets:
                    load_full(model, ((k, t.reshape(s)) for (k, s), t in
                                      zip(bucket, full, strict=True)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["BUCKET_BYTES", "bucket_plan", "check_gather", "gather_refusal", "named_weights",
           "sent_weights", "transfer", "whole"]
