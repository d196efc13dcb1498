"""Methods added to every vLLM worker (``worker_extension_cls``) for in-place weight updates.

    >>> LLM(path, worker_extension_cls=EXTENSION)                       # doctest: +SKIP
    >>> llm.collective_rpc("rpeg_begin_update")                         # doctest: +SKIP
    >>> llm.collective_rpc("rpeg_load_bucket", args=(names, tensors))   # doctest: +SKIP
    [1048576]
    >>> llm.collective_rpc("rpeg_finish_update")                        # doctest: +SKIP

vLLM imports this module by name inside each worker (a child process, or
this process when the engine runs without multiprocessing), so it imports
nothing of rpeg's but the weight-sync wire (``backends.vllm_backend.sync``,
torch only): ``rpeg_receive_weights`` joins a process group the trainer shares
and receives an update through collectives, in the trainer's dtype. An update uses vLLM's layerwise reload: ``begin`` puts
each layer back into checkpoint form (the loaded kernels are kept aside),
``load_bucket`` runs the model's own ``load_weights`` (Hugging Face names
onto fused q/k/v and gate/up parameters, each tensor-parallel worker keeping
its shard) and repacks a layer into kernel form as soon as all of its
weights have arrived, and ``finish`` restores any layer that received no
new weights. So a bucket may end in the middle of a layer, and an update may
carry only some layers.
"""

from __future__ import annotations

EXTENSION = "backends.vllm_backend.worker_ext.WeightSyncExtension"
_ALIGN = 16          # bytes: every packed tensor starts at a multiple, so any dtype can view it


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def rpeg_begin_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rpeg_load_bucket(self, names: list[str], tensors: list) -> int:
        """Load one bucket of parameters (Hugging Face names); returns the bytes received."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights=list(zip(names, tensors, strict=True)))
        return sum(int(t.numel() * t.element_size()) for t in tensors)

    def rpeg_load_packed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                         blob: bytes) -> int:
        """``rpeg_load_bucket`` for a bucket packed into one byte string (see ``pack``)."""
        return self.rpeg_load_bucket(names, unpack(dtypes, shapes, blob))

    def rpeg_load_ipc(self, names: list[str], handles: list) -> int:
        """``rpeg_load_bucket`` for a bucket on the sender's GPU, shared through CUDA IPC
        handles (vLLM's colocate path: an engine on its trainer's GPU). The engine's
        processes see its block's GPUs, the host's (the sender's) first, so each handle is
        reopened on visible device 0."""
        tensors = []
        for rebuild, args in handles:
            args = list(args)
            args[6] = 0                      # the storage's device, as this process sees it
            tensors.append(rebuild(*args))
        return self.rpeg_load_bucket(names, tensors)

    def rpeg_finish_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)

    def rpeg_receive_weights(self, addr: str, first_rank: int, world: int,
                             timeout_s: float | None = None) -> list[int]:
        """Join the trainer's weight-sync group (once; this worker's rank is ``first_rank`` +
        its tensor-parallel rank), receive one update and load it; returns [bytes, buckets]."""
        from backends.vllm_backend import sync

        group = getattr(self, "_rpeg_group", None)
        if group is None or self._rpeg_group_addr != addr:
            from vllm.distributed.parallel_state import get_tp_group
            rank = first_rank + get_tp_group().rank_in_group
            group = self._rpeg_group = sync.open_group(
                addr, rank, world, str(self.device),
                **({"timeout_s": timeout_s} if timeout_s else {}))
            self._rpeg_group_addr = addr
        self.rpeg_begin_update()
        total = count = 0
        for names, tensors in sync.receive(group, str(self.device)):
            total += self.rpeg_load_bucket(names, tensors)
            count += 1
        self.rpeg_finish_update()
        return [total, count]

    def rpeg_param_checksum(self, name: str) -> float:
        """Sum of one vLLM parameter (a cheap probe that an update reached the worker)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return float(params[name].detach().float().sum().item())


def pack(tensors: list) -> tuple[list[str], list[list[int]], bytes]:
    """Tensors as (dtype names, shapes, one byte string): what crosses to a worker process intact.

    vLLM's message encoding sends small tensors inline and its decoder, not knowing
    the argument types of an RPC, hands them back as lists; bytes arrive as bytes.
    """
    import torch

    parts = []
    for t in tensors:
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, torch.zeros(-len(raw) % _ALIGN, dtype=torch.uint8)]   # keep views aligned
    blob = torch.cat(parts).numpy().tobytes() if parts else b""
    return ([str(t.dtype).removeprefix("torch.") for t in tensors],
            [list(t.shape) for t in tensors], blob)


def ipc_handles(tensors: list) -> list:
    """CUDA IPC handles of GPU tensors (``torch.multiprocessing``'s own reduction): another
    process reopens each without a copy through the host. The caller keeps the tensors
    alive until the receiver has loaded them."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    for device in {t.device for t in tensors}:     # the gathered bytes are written before
        torch.cuda.synchronize(device)             # shared, on the GPU that holds them
    return [reduce_tensor(t.detach().contiguous()) for t in tensors]


def unpack(dtypes: list[str], shapes: list[list[int]], blob: bytes) -> list:
    import torch

    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    out, offset = [], 0
    for name, shape in zip(dtypes, shapes, strict=True):
        dtype = getattr(torch, name)
        count = 1
        for d in shape:
            count *= int(d)
        size = count * torch.empty((), dtype=dtype).element_size()
        out.append(buf[offset:offset + size].view(dtype).reshape(shape))
        offset += size + (-size % _ALIGN)
    return out
