"""Data and tensor parallelism across Dask workers: one torch.distributed world.

    >>> init_world(rank=0, world_size=2, addr="tcp://127.0.0.1:29512", groups=[(0, 1)])  # doctest: +SKIP
    >>> heads = wrap_ddp(TokenHeads(model), world=(0, 1), device="cpu")   # DP: doctest: +SKIP
    >>> shard_tp(model, group=(0, 1), device="cpu")                       # TP: doctest: +SKIP
    >>> sorted(TP_PLAN)[:2]
    ['mlp.down_proj', 'mlp.gate_proj']

Every worker joins one world at set-up (gloo on CPU, NCCL on CUDA), rank =
device index. Process groups are created on every rank in the same order, as
torch requires.

* **Data parallel** (tp = 1): a model trained on devices ``world`` gets a
  ``DistributedDataParallel`` wrapper over exactly those ranks; gradients are
  averaged in buckets during backward.
* **Tensor parallel** (tp > 1): each decoder layer's attention projections and
  MLP are split Megatron-style with DTensor (``parallelize_module``): q/k/v and
  gate/up column-wise (each rank holds ``heads / tp`` attention heads), o and
  down row-wise (one all-reduce per block). The embeddings and the output head
  are split over the vocabulary, as Megatron and torchtitan split them: each
  rank holds ``vocab / tp`` rows (tied embeddings stay one tensor), looks up
  the tokens it holds (one all-reduce), and computes its slice of the logits.
  The log-probabilities and the entropy are reduced over the slices without
  gathering them (:func:`token_log_probs`); sampling gathers one
  position's logits. Norms and the value head stay whole, so hidden
  states and values are identical on all ranks of the group, and sampling with
  one seed draws the same tokens.
  With dp x tp the gradients of each tensor-parallel shard are averaged over
  the ranks holding the same shard (hooks, one all-reduce per parameter).

Weights leave a sharded model as full tensors (:func:`full_state`, a
collective) or as per-rank shards that a reader concatenates without any
collective (:func:`shard_state`, :func:`join_shards`); full tensors are loaded
into a sharded model by slicing (:func:`load_full`, no collective either).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rpeg.cost.engines import LOGIT_CHUNK
from rpeg.runtime.dask.devices import COLLECTIVE_TIMEOUT_S

_GROUPS: dict[tuple[int, ...], object] = {}

# Megatron-style split of one Llama / Qwen2 decoder layer (as transformers' own tp plan).
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
           "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
           "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def init_world(rank: int, world_size: int, addr: str, groups: list[tuple[int, ...]],
               cuda_index: int | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the world and create every data-parallel group (all ranks, same order): gloo on
    CPU; NCCL on CUDA, this worker's GPU (``cuda_index``, as it sees its GPUs:
    ``rpeg.runtime.dask.devices``) made its current device first and bound to the world
    (``device_id``), so no rank's collectives, meshes or shards land on GPU 0 by default.
    A collective waits ``timeout_s`` for its partners, then fails."""
    if dist.is_initialized():
        return
    import datetime
    device = use_device(cuda_index)
    extra = {"device_id": device} if device is not None else {}
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if device is not None else "gloo",
                            store=rendezvous_store(addr, rank, world_size, timeout),
                            rank=rank, world_size=world_size, timeout=timeout, **extra)
    make_groups(groups)


def rendezvous_store(addr: str, rank: int, world_size: int, timeout,
                     wait_for_workers: bool = True) -> dist.TCPStore:
    """The store the ranks of a world meet at, ``addr`` (``tcp://HOST:PORT``): rank 0 serves
    it on HOST's address alone, the others connect to it. (torch's own ``tcp://`` rendezvous
    listens on every interface of rank 0's machine: anything that reaches the port could
    write the store.) The listening socket is made here, bound to HOST, and handed to the
    store (``master_listen_fd``), which owns it from then on."""
    import socket
    host, port = addr.split("://")[-1].rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=wait_for_workers, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def use_device(cuda_index: int | None):
    """This worker's GPU as its current device (None: CPU)."""
    if cuda_index is None:
        return None
    device = torch.device("cuda", cuda_index)
    torch.cuda.set_device(device)
    return device


def device_report() -> dict:
    """This worker's host and the GPUs torch can use here, by node-level id."""
    import socket

    from rpeg.runtime.dask.devices import visible_gpus
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"host": socket.gethostname(), "gpus": list(visible_gpus(count=n)[:n]) if n else []}


def make_groups(groups) -> None:
    """Create the process groups not made yet. Every rank must call this with the same list."""
    for g in groups:
        g = tuple(g)
        if g not in _GROUPS:
            _GROUPS[g] = dist.new_group(list(g))


def group_of(devices: tuple[int, ...]):
    group = _GROUPS.get(tuple(devices))
    if group is None:
        raise RuntimeError(f"no process group for devices {devices}: init_world first")
    return group


def wrap_ddp(module: torch.nn.Module, world: tuple[int, ...], device: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [torch.device(device).index] if device.startswith("cuda") else None
    # Buffers (rotary tables) are identical everywhere: do not broadcast them every forward.
    return DDP(module, process_group=group_of(world), device_ids=ids, forward_sync_buffers=False)


# --- tensor parallelism ----------------------------------------------------------------------

def tp_refusal(config, tp: int) -> str | None:
    """Why a model with this transformers ``config`` cannot be split ``tp`` ways, or None."""
    for what, n in (("attention heads", config.num_attention_heads),
                    ("KV heads", config.num_key_value_heads),
                    ("MLP width", config.intermediate_size)):
        if n % tp:
            return f"tp must divide the model's {n} {what}, not {tp}"
    return None


def shard_tp(model, group: tuple[int, ...], device: str, mesh=None):
    """Split ``model``'s decoder layers, embeddings and output head over the ranks ``group``
    in place; returns the mesh (``mesh``: the tensor-parallel dimension of a 2-D mesh, when
    FSDP2 shards the rest).

    Every rank built the same full weights (same seed or folder), so each keeps its own
    slice without communication (``src_data_rank=None``), or the model is shapes alone
    (``meta``), split here and filled after (``sharding.fill_shards``). The head's output
    stays a DTensor sharded over the vocabulary (``Shard(-1)``): :func:`token_log_probs`
    reduces it, :func:`backends.torch_backend.weights.whole` gathers it.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from rpeg.errors import BackendError

    why = tp_refusal(model.config, len(group))
    if why:
        raise BackendError(why, hint="pick a tp that divides the head counts, or tp = 1")
    if mesh is None:
        mesh = DeviceMesh.from_group(group_of(group), torch.device(device).type)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in TP_PLAN.items()}
    for layer in model.backbone.layers:
        parallelize_module(layer, mesh, plan, src_data_rank=None)
    head = model.lm_head
    tied = head is not None and head.weight is model.backbone.embed_tokens.weight
    model.backbone.embed_tokens = VocabSplitEmbedding(model.backbone.embed_tokens, mesh)
    if head is not None:
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1),
                                                       use_local_output=False),
                           src_data_rank=None)
        if tied:        # each was split on its own: one tensor again, as the model has it
            head.weight = model.backbone.embed_tokens.weight
    return mesh


class VocabSplitEmbedding(torch.nn.Module):
    """An embedding table split by rows (vocabulary) over a tensor-parallel mesh, as
    Megatron's: each rank looks up the tokens in its rows (zeros elsewhere) and one
    all-reduce sums the ranks' lookups. Its gradient stays in each rank's rows. (A DTensor
    ``RowwiseParallel`` embedding computes the whole table's gradient on every rank.)"""

    def __init__(self, whole: torch.nn.Embedding, mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor
        super().__init__()
        self.weight = torch.nn.Parameter(distribute_tensor(
            whole.weight.detach(), mesh, [Shard(0)], src_data_rank=None),
            requires_grad=whole.weight.requires_grad)
        self.padding_idx = whole.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        rows = self.weight.to_local()
        lo = _first_row(self.weight.shape[0], mesh)
        here = (ids >= lo) & (ids < lo + rows.shape[0])
        pad = self.padding_idx
        local_pad = pad - lo if pad is not None and lo <= pad < lo + rows.shape[0] else None
        out = torch.nn.functional.embedding((ids - lo).clamp(0, max(rows.shape[0] - 1, 0)),
                                            rows, padding_idx=local_pad)
        return _sum_over(out * here[..., None].to(out.dtype), mesh.get_group())


def _first_row(rows: int, mesh) -> int:
    """The first row this rank holds of ``rows`` split by ``Shard`` (torch.chunk's split)."""
    width = -(-rows // mesh.size())
    return min(mesh.get_local_rank() * width, rows)


def token_log_probs(logits, targets: torch.Tensor, temperature: float = 1.0,
                    own: bool = False):
    """(log-probability of each target, entropy) per position of ``logits`` [..., vocab] at
    ``temperature``: whole, or split over the vocabulary (a DTensor ``Shard(-1)``,
    :func:`shard_tp`'s head), never gathered.

    The logits are kept once, in their own dtype (bf16 on a GPU), and nothing else as large:
    the float32 log-softmax runs over chunks of positions, forward and again in the
    backward, as verl's and TRL's memory-lean log-probabilities do. With ``own`` (the caller
    made the logits and reads them no more), the backward writes their gradient over them,
    as Liger's fused cross-entropy does, and runs once (no ``retain_graph``). Split logits are
    reduced over the ranks in two all-reduces of a few numbers per position (the maximum;
    then the sums of the exponentials, of their products with the logits, and the target's
    logit, which one rank holds); the backward needs no communication."""
    from torch.distributed.tensor import DTensor
    group, lo = None, 0
    if isinstance(logits, DTensor):
        assert _shard_dim(logits) == logits.dim() - 1, logits.placements
        group, lo = logits.device_mesh.get_group(), _first_row(logits.shape[-1],
                                                                logits.device_mesh)
        logits = logits.to_local()
    shape = targets.shape
    lp, ent = _TokenLogProbs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   float(temperature), lo, group, own)
    return lp.view(shape), ent.view(shape)


class _TokenLogProbs(torch.autograd.Function):
    """See :func:`token_log_probs`. ``logits`` [N, V] (this rank's columns, from ``lo``).
    A chunk of ``LOGIT_CHUNK`` values is worked on in float32 with two copies of it alive
    (``rpeg.cost.engines.LOGIT_WORK_COPIES``): each step of a chunk runs in place, and with
    ``own`` the backward writes the gradient over the logits."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, lo: int, group, own: bool):
        n, width = logits.shape
        rows = max(1, LOGIT_CHUNK // max(width, 1))
        top = torch.empty(n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, rows):
            top[a:a + rows] = logits[a:a + rows].amax(-1).float() / temperature
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty(3, n, dtype=torch.float32, device=logits.device)
        here = (targets >= lo) & (targets < lo + width)
        idx = (targets - lo).clamp(0, max(width - 1, 0))
        for a in range(0, n, rows):
            _chunk_sums(logits[a:a + rows], idx[a:a + rows], temperature, top[a:a + rows],
                        sums[:, a:a + rows])
        sums[2] *= here
        if group is not None:
            dist.all_reduce(sums, group=group)
        log_z = top + torch.log(sums[0])
        mean_z = sums[1] / sums[0]                   # E_p[z]
        ctx.save_for_backward(logits, idx, here, log_z, mean_z)
        ctx.temperature, ctx.rows, ctx.own = temperature, rows, own
        return sums[2] - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        if getattr(ctx, "spent", False):
            raise RuntimeError("token_log_probs(own=True)'s backward runs once: it wrote the "
                               "logits' gradient over the logits (no retain_graph)")
        logits, idx, here, log_z, mean_z = ctx.saved_tensors
        g_lp = torch.zeros_like(log_z) if g_lp is None else g_lp.float()
        g_ent = torch.zeros_like(log_z) if g_ent is None else g_ent.float()
        rows = ctx.rows
        # each chunk's gradient written as its logits are read for the last time: owned
        # logits hold their own gradient, so a train step keeps one logits-sized tensor
        grad = logits if ctx.own else torch.empty_like(logits)
        ctx.spent = ctx.own
        for a in range(0, logits.shape[0], rows):
            b = slice(a, a + rows)
            grad[b] = _chunk_grad(logits[b], idx[b], here[b], ctx.temperature, log_z[b],
                                  mean_z[b], g_lp[b], g_ent[b])
        return grad, None, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A float32 copy of ``logits`` / ``temperature`` (one chunk-sized allocation)."""
    z = logits.to(torch.float32, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_sums(logits, idx, temperature, top, out) -> None:
    """Into ``out`` [3, rows]: the sum of exp(z - top), of exp(z - top) z, and z at ``idx``."""
    z = _scaled(logits, temperature)
    out[2] = z.gather(-1, idx[:, None]).squeeze(-1)
    e = (z - top[:, None]).exp_()
    out[0] = e.sum(-1)
    out[1] = e.mul_(z).sum(-1)


def _chunk_grad(logits, idx, here, temperature, log_z, mean_z, g_lp, g_ent):
    """The gradient of one chunk's logits: d lp / dz = onehot - p, d entropy / dz =
    -p (z - E_p[z]), dz / dlogits = 1 / T; as ``g_lp (onehot - p) - g_ent p (z - E_p[z])``."""
    z = _scaled(logits, temperature)
    p = (z - log_z[:, None]).exp_()
    gz = z.sub_(mean_z[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    del p
    gz.scatter_add_(-1, idx[:, None], (g_lp * here)[:, None])
    return gz.div_(temperature) if temperature != 1.0 else gz


class _SumOver(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank computes the same loss from
    the sum and back-propagates it into its own term alone (Megatron's reduction from the
    tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOver.apply(x, group)


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _shard_dim(t) -> int | None:
    from torch.distributed.tensor import Shard
    for p in t.placements:
        if isinstance(p, Shard):
            return p.dim
    return None


def full_state(model) -> dict[str, torch.Tensor]:
    """``state_dict`` with every sharded tensor gathered whole (a collective over its group)."""
    return {k: (v.full_tensor() if is_sharded(v) else v) for k, v in model.state_dict().items()}


def shard_state(model) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's piece of each tensor and the dimension it was cut along (None: whole)."""
    return {k: ((v.to_local(), _shard_dim(v)) if is_sharded(v) else (v, None))
            for k, v in model.state_dict().items()}


def join_shards(parts: list[tuple[torch.Tensor, int | None]]) -> torch.Tensor:
    """One tensor from the pieces of every rank (in rank order), as ``shard_state`` cut it."""
    first, dim = parts[0]
    return first if dim is None else torch.cat([p for p, _ in parts], dim=dim)


def local_piece(own, full: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` that the (possibly sharded) tensor ``own`` holds on this rank:
    a tensor-parallel shard, an FSDP2 shard, or both (2-D); cut locally, no collective."""
    if not is_sharded(own):
        return full
    from torch.distributed.tensor import distribute_tensor
    full = full.to(own.to_local().device)
    return distribute_tensor(full, own.device_mesh, own.placements,
                             src_data_rank=None).to_local()


def load_full(model, tensors) -> None:
    """Copy full tensors ``(name, value)`` into ``model``, each rank its own slice."""
    own = model.state_dict()
    with torch.no_grad():
        for name, value in tensors:
            target = own[name]
            piece = local_piece(target, torch.as_tensor(value))
            local = target.to_local() if is_sharded(target) else target
            local.copy_(piece)


def pieces(model, optimizer=None) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's pieces of the weights and of the Adam moments (``name::exp_avg``)."""
    out = {k: (t.detach().cpu().float().clone(), d) for k, (t, d) in shard_state(model).items()}
    if optimizer is not None:
        for name, p in model.named_parameters():
            for key, val in optimizer.state.get(p, {}).items():
                if torch.is_tensor(val) and val.dim() > 0:
                    local, dim = (val.to_local(), _shard_dim(val)) if is_sharded(val) \
                        else (val, None)
                    out[f"{name}::{key}"] = (local.detach().cpu().clone(), dim)
    return out


def join_pieces(by_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's :func:`pieces` (rank order)."""
    return {k: join_shards([r[k] for r in by_rank]) for k in by_rank[0]}


def as_local(param, full: torch.Tensor):
    """Optimizer state for ``param`` from its whole value: a DTensor like ``param`` if split."""
    if not is_sharded(param):          # a copy of its own (not a file's mapped storage)
        return full.to(param.device, copy=True)
    from torch.distributed.tensor import DTensor
    piece = local_piece(param, full).to(param.to_local().device).contiguous()
    # the global shape given: an uneven split (FSDP2, fewer rows than ranks) is not inferred
    return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Clip gradients to ``max_norm`` in total over whole tensors, tensor-parallel shards,
    FSDP2 shards and 2-D DTensors alike; returns the total norm (the same on every rank).

    A DTensor's squared norm is summed over the ranks that shard it (one all-reduce per
    distinct mesh and sharded mesh dimension, in parameter order on every rank); a whole
    tensor's counts once, as every rank of its group holds the same value."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(p, DTensor) for p in params):
        if not grads:
            return torch.zeros(())
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    device = _local(params[0]).device
    total = torch.zeros((), device=device, dtype=torch.float32)
    sums: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, object] = {}
    for p in params:       # every rank the same keys, also where its shard has no gradient
        g = p.grad
        local = _local(g).float().pow(2).sum() if g is not None \
            else torch.zeros((), device=device)
        if not isinstance(p, DTensor):
            total += local
            continue
        # FSDP2 over a tensor-parallel shard is a _StridedShard, which is_shard() denies
        dims = tuple(i for i, pl in enumerate(p.placements)
                     if not (pl.is_replicate() or pl.is_partial()))
        key = (id(p.device_mesh), dims)
        sums[key] = sums.get(key, torch.zeros((), device=device)) + local
        meshes[key] = p.device_mesh
    for key, value in sums.items():
        for d in key[1]:
            dist.all_reduce(value, group=meshes[key].get_group(d))
        total += value
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in grads:
            _local(g).mul_(coef)
    return norm


def _local(t):
    return t.to_local() if is_sharded(t) else t


def average_over(params, devices: tuple[int, ...]) -> None:
    """Average each parameter's gradient over the ranks ``devices`` as backward makes it
    (data parallelism next to tensor parallelism: the ranks holding the same shard)."""
    group, n = group_of(devices), len(devices)

    def hook(p):
        local = p.grad.to_local() if is_sharded(p.grad) else p.grad
        dist.all_reduce(local, group=group)
        local.div_(n)

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)


def shutdown_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUPS.clear()
