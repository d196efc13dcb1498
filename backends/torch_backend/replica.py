"""A copy of a backbone on one device, as the torch backend holds it between ops.

    >>> replica = Replica(spec, pipeline, device="cpu", device_index=0)   # doctest: +SKIP
    >>> replica.version, replica.trained is not None                       # doctest: +SKIP
    (0, True)

Built from the spec's seed or weights folder; a trained replica laid out as the plan says
(``sharding.Trained``: DDP, FSDP2, tensor parallelism), a read one whole or tensor-parallel,
with a torch engine beside it when it has an LM head and holds its weights whole.
"""

from __future__ import annotations

import torch

from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.modeling import build_model
from backends.torch_backend.train import TokenHeads
from rpeg.errors import BackendError
from rpeg.runtime.lowering.instances import base_of


class Replica:
    """One copy of a backbone on this device: built from the spec's seed or folder, laid out
    as the plan says (trained: ``sharding.Trained``; read: whole or tensor-parallel), kept in
    the parameter dtype (``sharding.param_dtype``)."""

    def __init__(self, spec, pipeline, device: str, device_index: int) -> None:
        from backends.torch_backend.sharding import Trained, TrainLayout, param_dtype
        members = [pipeline.model(m) for m in base_of(spec.model).members]
        dims = members[0].dims
        weights = next((m.weights for m in members if m.weights), None)
        self.dtype = param_dtype(members[0].dtype, device)
        self.device, self.device_index = device, device_index
        self.lora = next((m.lora for m in members if m.lora is not None), None)
        self.tp = tuple(getattr(spec, "tp", ()))
        layout = TrainLayout(tuple(spec.world), self.tp, spec.layout) if spec.trainable else None
        # built in float32 for a trained replica (its masters, or FSDP2's float32 shards,
        # come from these) and in its parameter dtype for a reader: on its device, or where
        # its ranks split it (FSDP2, tensor parallelism), as shapes alone on every rank
        # but the first, which holds the whole weights in host memory (a folder's in the
        # dtype it saves them in) and sends each rank its shards (sharding.fill_shards):
        # no rank holds the whole model on its device
        split = self.lora is None and (len(self.tp) > 1 or layout is not None and layout.fsdp)
        ranks = (layout.world if layout is not None else self.tp) if split else ()
        whole = build_model(dims, spec.heads, seed=pipeline.workload.seed, weights=weights,
                            device="cpu", dtype="auto") \
            if split and device_index == ranks[0] else None
        self.model = build_model(dims, spec.heads, seed=pipeline.workload.seed,
                                 weights=weights, device="meta" if split else device,
                                 dtype=torch.float32 if spec.trainable else self.dtype)
        if self.lora is not None and len(self.tp) > 1:
            raise BackendError(f"model '{members[0].name}' trains LoRA adapters, which this "
                               "backend runs at tp = 1 only", members[0].span,
                               hint="pin the actor's stages to tp = 1 (place ... { tp = 1 })")
        if self.lora is not None and spec.trainable and spec.layout.zero.shards_grads:
            raise BackendError(f"model '{members[0].name}' trains LoRA adapters, which this "
                               f"backend trains whole (zero 0), not under FSDP2 (zero "
                               f"{spec.layout.zero})", members[0].span,
                               hint="plan it with rpeg compile's default limits")
        if self.lora is not None:               # adapters train, the backbone is frozen
            from backends.torch_backend.lora import apply_lora
            apply_lora(self.model, self.lora, seed=pipeline.workload.seed)
        if not split:
            self.model = self.model.to(device)
        self.version = 0
        self.heads = TokenHeads(self.model)
        self.trained = None
        self.optimizer_spec = None
        self.grad_clip = 1.0
        self.kl_coef: dict[str, float] = {}        # adaptive KL coefficients, by train stage
        if spec.trainable:
            self.optimizer_spec = next(m.optimizer for m in members if m.optimizer is not None)
            self.trained = Trained.build(self.model, self.heads, members, layout, device=device,
                                         dtype=self.dtype, master=self.optimizer_spec.master,
                                         device_index=device_index, whole=whole)
            self.grad_clip = self.optimizer_spec.grad_clip
        else:
            if len(self.tp) > 1:
                from backends.torch_backend.distributed import shard_tp
                shard_tp(self.model, self.tp, device)
            if split:
                from backends.torch_backend.sharding import fill_shards
                self.model.to_empty(device=device)
                fill_shards(self.model, whole, self.tp, device)
            self.model.to(self.dtype)
            self.model.requires_grad_(False)
        # ZeRO-3 keeps only a shard between ops: readers here read a whole copy instead
        readable = self.trained is None or not self.trained.layout.zero.shards_params
        self.engine = TorchEngine(self.model, device=device) \
            if "lm" in spec.heads and readable else None

    @property
    def optimizer(self):
        return self.trained.optimizer if self.trained is not None else None

    @property
    def train_heads(self):
        return self.trained.heads if self.trained is not None else self.heads

    @property
    def sharded(self) -> bool:
        return len(self.tp) > 1

    @property
    def fsdp(self) -> bool:
        return self.trained is not None and self.trained.layout.fsdp

    def weights(self):
        """(name, tensor) of every parameter as this device holds it, without touching how
        it is laid out (an engine on this device reads them)."""
        from backends.torch_backend.weights import named_weights
        return named_weights(self.model)
