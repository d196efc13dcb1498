"""A trained replica laid out as its plan says: DDP, FSDP2 (ZeRO-2 / ZeRO-3), DTensor tensor
parallelism and both on a 2-D mesh; activation checkpointing; optimizer offload; precision.

    >>> layout = TrainLayout.of((0, 1), zero=3, recompute=True)
    >>> layout.dp, layout.fsdp
    (2, True)
    >>> trained = Trained.build(model, members, layout, device="cpu",       # doctest: +SKIP
    ...                         dtype=torch.float32, master=True)
    >>> stats = train_step(trained.heads, trained.optimizer, batch, losses, ...)  # doctest: +SKIP

Where its ranks split it (FSDP2, tensor parallelism), every rank of ``world`` but the
first builds the model as shapes alone (``meta``) and splits it; the first builds the whole
weights in host memory (from the seed or folder) and sends each tensor in turn, of which
each rank keeps its slice (:func:`fill_shards`): no rank holds more than its shards and one
whole tensor on its device, as the cost model prices a split replica, so a model larger
than one device launches. ZeRO levels, as ``rpeg.cost.memory`` prices them:

* **0** — weights, gradients and optimizer state whole on every rank. Gradients are
  averaged by ``DistributedDataParallel`` (tp = 1) or by per-parameter all-reduce hooks
  over the ranks holding the same tensor-parallel shard (tp > 1).
* **2** — FSDP2 (``fully_shard``) on every decoder layer and on the root, with
  ``reshard_after_forward=False``: gradients and optimizer state are sharded over the
  data-parallel ranks; after each train op the weights are gathered whole again
  (``unshard``) and stay whole, so readers on these devices (generation, forward ops)
  read them in place, without collectives.
* **3** — FSDP2 with ``reshard_after_forward=True``: between ops each rank holds 1/dp of
  weights, gradients and optimizer state; a layer's weights are gathered while it runs.
  Readers on these devices read a whole copy that weight sync fills.

ZeRO-1 (optimizer state alone sharded) is not executed: the backend declares levels 0, 2
and 3 (``capabilities.py``). With tp > 1, FSDP2 shards over the data-parallel dimension of
a 2-D (dp, tp) device mesh, after the tensor-parallel split.

Precision: parameters are kept in ``dtype`` (the model's, bf16 on a GPU; float32 on a
CPU, whose profile prices float32). With ``master`` and a 16-bit dtype, the optimizer
updates float32 master weights: FSDP2 keeps the sharded parameters in float32,
gathers them in ``dtype`` and reduces the gradients in it (``MixedPrecisionPolicy``,
:func:`reduce_dtype`: the cost model's rule, so priced as run); DDP and tensor parallelism keep a
float32 copy in the optimizer (:class:`MasterAdam`). ``recompute`` checkpoints each
decoder layer's activations (recomputed in backward). ``offload`` keeps the optimizer
state in host memory between train ops (:class:`HostOffload`).
"""

from __future__ import annotations

import contextlib

import attrs
import torch
from torch import nn

from backends.torch_backend.optim import MasterAdam, build_optimizer
from rpeg.cost.memory import fsdp_runs
from rpeg.cost.passes import dp_group, train_groups
from rpeg.errors import BackendError
from rpeg.graph.layout import LAYOUT, Layout, layout_of
from rpeg.spec.model import Zero

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FSDP_LEVELS = (Zero.GRADIENTS, Zero.WEIGHTS)
LEVELS = (Zero.NONE,) + FSDP_LEVELS


@attrs.frozen
class TrainLayout:
    """How a trained replica is laid out over the devices that train it: its trainer's
    :class:`~rpeg.graph.layout.Layout` (what the plan placed and the cost model priced), seen
    from one device."""

    world: tuple[int, ...]          # devices training it: dp blocks of len(tp) devices
    tp: tuple[int, ...] = ()        # this device's tensor-parallel group (len > 1: split)
    layout: Layout = LAYOUT         # the trainer's: ZeRO level, recomputation, offload

    @classmethod
    def of(cls, world: tuple[int, ...], tp: tuple[int, ...] = (), **layout) -> TrainLayout:
        """A layout over ``world`` from the trainer's flat fields (``zero``, ``recompute``,
        ``offload``)."""
        return cls(tuple(world), tuple(tp), layout_of(**layout))

    @property
    def zero(self) -> Zero:
        return self.layout.zero

    @property
    def recompute(self) -> bool:
        return self.layout.recompute

    @property
    def offload(self) -> bool:
        return self.layout.offload

    @property
    def tp_size(self) -> int:
        return max(len(self.tp), 1)

    @property
    def dp(self) -> int:
        return max(len(self.world) // self.tp_size, 1)

    @property
    def fsdp(self) -> bool:
        """FSDP2 runs it, over the data-parallel ranks (:func:`rpeg.cost.memory.fsdp_runs`,
        by which the cost model prices it)."""
        return fsdp_runs(self.zero, self.dp, self.tp_size)

    def dp_peers(self, device: int) -> tuple[int, ...]:
        """The devices of ``world`` holding the same tensor-parallel shard as ``device``
        (the cost model's data-parallel group, ``rpeg.cost.passes.dp_group``)."""
        return dp_group(self.world, Layout(tp=self.tp_size), self.world.index(device))


def param_dtype(model_dtype: str, device: str) -> torch.dtype:
    """The dtype a replica keeps its parameters in: the model's on a GPU, float32 on a CPU
    (the CPU profile prices float32: ``compute_bytes = 4``)."""
    if not str(device).startswith("cuda"):
        return torch.float32
    return DTYPES[model_dtype]


# --- building -----------------------------------------------------------------------------

class Trained:
    """A trained replica's training side: what ``train_step`` calls, its optimizer, and the
    work around a train op (gathering ZeRO-2 weights, moving offloaded state)."""

    def __init__(self, model, heads, layout: TrainLayout, optimizer, offload) -> None:
        self.model = model
        self.heads = heads              # what train_step calls (DDP / FSDP2 root / plain)
        self.layout = layout
        self.optimizer = optimizer
        self.offload = offload

    @classmethod
    def build(cls, model, heads, members, layout: TrainLayout, *, device: str,
              dtype: torch.dtype, master: bool, device_index: int,
              whole: nn.Module | None = None) -> Trained:
        """Lay out ``model`` (and ``heads``, the module over it that training calls) for
        training; every rank of ``layout.world`` calls this at once (FSDP2 is collective).

        Where its ranks split it (FSDP2, tensor parallelism), ``model`` may be shapes alone
        (on the ``meta`` device) on every rank: split first, each rank's shards are then
        allocated on its device and filled from ``whole``, the same model with its weights,
        which the first rank of the world holds (None elsewhere; :func:`fill_shards`). So no
        rank holds more of the weights than its shards and one tensor, and only the first
        holds them whole, in host memory."""
        from backends.torch_backend import distributed as D

        if layout.zero not in LEVELS:
            raise BackendError(f"zero must be one of {', '.join(map(str, LEVELS))} in the torch "
                               f"backend, not {layout.zero}",
                               hint="ZeRO-1 is not executed: plan with zero 0, 2 or 3")
        mixed = master and dtype != torch.float32
        meshes = fsdp_meshes(layout, device, device_index) if layout.fsdp else None
        if len(layout.tp) > 1:
            D.shard_tp(model, layout.tp, device, mesh=meshes[1] if meshes else None)
        if not layout.fsdp and any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)      # tensor parallel alone: its shards filled
            fill_shards(model, whole, layout.world, device)
        if layout.recompute:
            recompute_layers(model.backbone)
        if layout.fsdp:
            if not mixed:
                model.to(dtype)           # with master weights FSDP2 keeps float32 shards
            heads = _fully_shard(model, heads, layout, meshes[0], device,
                                 dtype if mixed else None, whole)
            optimizer = make_optimizer(model, members, master=False)
        else:
            optimizer = make_optimizer(model, members, master=mixed)   # masters from float32
            model.to(dtype)
            if len(layout.tp) > 1 and layout.dp > 1:
                D.average_over(model.parameters(), layout.dp_peers(device_index))
            elif layout.dp > 1:
                heads = D.wrap_ddp(heads, layout.world, device)
        offload = HostOffload(optimizer, device) if layout.offload else None
        trained = cls(model, heads, layout, optimizer, offload)
        trained.settle()
        return trained

    # --- around a train op --------------------------------------------------------------
    def before_step(self) -> None:
        """Called by every rank before a train op: the sharded parameters registered again
        (FSDP2 gathers each layer as it runs), the offloaded state back on the device."""
        self.unsettle()
        if self.offload is not None:
            self.offload.bring_in()

    def after_step(self) -> None:
        """Called by every rank at the end of a train op: gather ZeRO-2 weights whole again
        (a collective), send offloaded state back to the host."""
        if self.offload is not None:
            self.offload.send_out()
        self.settle()

    @contextlib.contextmanager
    def state_on_device(self):
        """The optimizer state on the device inside the block (a checkpoint reads or writes
        it), in host memory again after it when offloaded."""
        if self.offload is None or not self.offload.out:     # on the device already
            yield
            return
        self.offload.bring_in()
        try:
            yield
        finally:
            self.offload.send_out()

    def settle(self) -> None:
        """The between-ops state of the weights: ZeRO-2 whole (collective), else as they are."""
        if self.layout.fsdp and self.layout.zero.keeps_gathered:
            for m in fsdp_modules(self.heads):
                m.unshard()

    def unsettle(self) -> None:
        """Register the sharded parameters again (local): before reading or writing them.
        FSDP2 also forgets the order of the forwards since the last backward: a reader on
        this device (generation, a forward op) ran the layers of a ZeRO-2 trainer in place,
        on this rank alone, and the next backward would prefetch (all-gather) by that order
        on this rank only, waiting for the other ranks forever."""
        if self.layout.fsdp:
            forget_forwards(self.heads)
            for m in fsdp_modules(self.heads):
                m.reshard()

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.heads.parameters() if p.requires_grad]


def recompute_layers(backbone) -> None:
    """Checkpoint each decoder layer's activations (non-reentrant, recomputed in backward),
    through transformers' own switch (renamed in transformers 5.2x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def fsdp_modules(root: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def reduce_dtype(param: torch.dtype) -> torch.dtype:
    """The dtype data-parallel ranks reduce gradients in, by the cost model's rule
    (``rpeg.cost.memory.grad_reduce_bytes``): the weights' own, 16 bits on a GPU."""
    from rpeg.cost.memory import grad_reduce_bytes
    size = torch.empty((), dtype=param).element_size()
    return param if grad_reduce_bytes(size) == size else torch.float32


def forget_forwards(root: nn.Module) -> None:
    """Clear what FSDP2 recorded of the forwards run since its last backward (the order it
    prefetches the backward's all-gathers by), on the FSDP2 ``root``; every group resharded."""
    reset = getattr(root, "reset_iter_state", None)
    if callable(reset):                  # torch >= 2.12
        reset()
        return
    state = root._get_fsdp_state()       # earlier: the same trackers, cleared by hand
    state._comm_ctx.post_forward_order.clear()
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group._post_forward_indices.clear()


def _fully_shard(model, heads, layout: TrainLayout, mesh, device: str,
                 compute_dtype: torch.dtype | None, whole: nn.Module | None = None):
    """FSDP2 on each decoder layer, then on the ``heads`` root (embeddings, final norm and
    heads); shards of a model built as shapes alone allocated and filled from ``whole``
    (:func:`fill_shards`); a no-gradient forward of one token initialises the root on
    every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype,
                              reduce_dtype=reduce_dtype(compute_dtype)) \
        if compute_dtype is not None else MixedPrecisionPolicy()
    again = layout.zero.shards_params
    for layer in model.backbone.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=again, mp_policy=mp)
    fully_shard(heads, mesh=mesh, reshard_after_forward=again, mp_policy=mp)
    if any(p.is_meta for p in model.parameters()):
        heads.to_empty(device=device)
        fill_shards(model, whole, layout.world, device)
    ids = torch.full((1, 1), 3, dtype=torch.long, device=device)
    with torch.no_grad():           # FSDP2 needs its root run before any submodule
        heads(ids, torch.ones_like(ids), torch.zeros_like(ids))
    for m in fsdp_modules(heads):   # the sharded parameters are what the optimizer updates
        m.reshard()
    return heads


def fill_shards(model: nn.Module, whole: nn.Module | None, world: tuple[int, ...],
                device: str) -> None:
    """Fill ``model``'s parameters and buffers (allocated, unset: each rank's shards, or a
    tensor FSDP2 keeps whole) from ``whole``, which the first rank of ``world`` holds (None
    on the others): tensor by tensor, in one order on every rank, the first rank
    broadcasts it whole over the world's group, in the dtype this rank keeps it in, and
    each rank keeps its slice (:func:`~backends.torch_backend.distributed.local_piece`).
    A rank holds one whole tensor at a time beside its shards."""
    import torch.distributed as dist

    from backends.torch_backend.distributed import group_of, is_sharded, local_piece

    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    given = None if whole is None else \
        {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    group = group_of(tuple(world))
    with torch.no_grad():
        for name in sorted(mine):
            target = mine[name]
            local = target.to_local() if is_sharded(target) else target
            if given is not None:
                full = given[name].detach().to(device=device, dtype=local.dtype)
            else:
                full = torch.empty(target.shape, dtype=local.dtype, device=device)
            dist.broadcast(full, src=world[0], group=group)
            local.copy_(local_piece(target, full))


def fsdp_meshes(layout: TrainLayout, device: str, device_index: int):
    """(the mesh FSDP2 shards over, the tensor-parallel mesh or None): 1-D over ``world``, or
    the two dimensions of one (dp, tp) mesh (FSDP2 requires both from one parent)."""
    from torch.distributed.device_mesh import DeviceMesh

    from backends.torch_backend.distributed import group_of

    kind = torch.device(device).type
    if layout.tp_size == 1:
        return DeviceMesh.from_group(group_of(layout.world), kind), None
    grid = torch.tensor(layout.world).reshape(layout.dp, layout.tp_size)
    mesh = DeviceMesh.from_group([group_of(layout.dp_peers(device_index)), group_of(layout.tp)],
                                 kind, mesh=grid, mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def mesh_groups(layout: TrainLayout) -> list[tuple[int, ...]]:
    """Process groups a layout needs (every rank creates all of a run's, in one order): the
    runtime's rule, ``rpeg.cost.passes.train_groups``."""
    return list(train_groups(tuple(layout.world), layout.tp_size, layout.zero))


# --- the optimizer ------------------------------------------------------------------------

def make_optimizer(model, members, master: bool):
    """The members' optimizer (``optim.build_optimizer``: its kind, rates and schedule), over
    float32 masters with ``master``."""
    return build_optimizer(model, members, master=master)[0]


def optimizer_state(optimizer, p) -> dict:
    """The Adam state of parameter ``p`` (moments and step), whichever optimizer holds it."""
    if isinstance(optimizer, MasterAdam):
        return optimizer.moments(p)
    return optimizer.state.get(p, {})


def state_tensors(optimizer) -> list[torch.Tensor]:
    if isinstance(optimizer, MasterAdam):
        return optimizer.state_tensors()
    return [t for st in optimizer.state.values() for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0]


# --- optimizer offload --------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class HostOffload:
    """The optimizer state (moments, and master weights) in host memory between train ops.

    ``send_out`` copies each state tensor to a host buffer and frees its device storage;
    ``bring_in`` allocates it again and copies back. On a GPU the host buffers are pinned
    and kept; on a CPU device they are freed as each tensor comes back (host memory is the
    device's memory there, so offload moves bytes without saving any, as the cost model
    prices it for such devices)."""

    def __init__(self, optimizer, device: str) -> None:
        self.optimizer = optimizer
        self.device = device
        self.cuda = str(device).startswith("cuda")
        self.host: list[torch.Tensor | None] = []
        self.out = False

    def send_out(self) -> None:
        tensors = [_local(t) for t in state_tensors(self.optimizer)]
        if len(self.host) != len(tensors):
            self.host = [None] * len(tensors)
        for i, t in enumerate(tensors):
            if self.host[i] is None:
                self.host[i] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                           pin_memory=self.cuda)
            self.host[i].copy_(t, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)      # this worker's GPU, not the current one
        for t in tensors:
            t.untyped_storage().resize_(0)
        self.out = True

    def bring_in(self) -> None:
        if not self.out:
            return
        tensors = [_local(t) for t in state_tensors(self.optimizer)]
        for i, t in enumerate(tensors):
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(self.host[i], non_blocking=self.cuda)
            if not self.cuda:
                self.host[i] = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.out = False


__all__ = ["DTYPES", "HostOffload", "LEVELS", "TrainLayout", "Trained",
           "fsdp_meshes", "fsdp_modules", "make_optimizer", "mesh_groups",
           "optimizer_state", "param_dtype", "state_tensors"]
