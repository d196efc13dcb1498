"""Per-GPU memory: what a model keeps between stages, and what an op needs while it runs.

    >>> from rpeg.spec.model import Model
    >>> from rpeg.spec.presets import PRESETS
    >>> from rpeg.cost.profiles import cluster_of
    >>> gh = cluster_of("gh200", gpus_per_node=4, nodes=1)
    >>> actor = Model("actor", "llama3.1-8b", PRESETS["llama3.1-8b"])
    >>> m = resident_memory(actor, Layout(tp=1), gh, trained=True)
    >>> round(m.total / 1e9, 1)          # 16 bytes per parameter
    128.5
    >>> round(resident_memory(actor, Layout(tp=4), gh, trained=True).total / 1e9, 1)
    32.1

Convention for training state (mixed precision Adam, the usual 16 B/parameter):
bf16 weights (2) + bf16 gradients (2) + fp32 master weights, first and second
moments (4 + 4 + 4). On a device that computes in fp32 (``compute_bytes = 4``,
the CPU profile) there is no separate master copy: fp32 weights (4) + fp32
gradients (4) + moments (4 + 4) — also 16 B. ``Layout.zero`` shards the
optimizer state (1), also the gradients (2), also the weights (3) over the data-parallel
ranks (DP x CP: a context-parallel group holds one copy of the model too, as Megatron's
distributed optimizer and FSDP with sequence parallelism shard it).
``Layout.offload`` keeps the optimizer state in host memory between train steps
(verl-style): it is not resident, it is brought in for the train step only — except on
devices whose memory is the host's (a CPU profile, ``host_cores``), where it stays counted.
``Layout.param_offload`` keeps the weights (and, trained, the gradients) in host memory
too: a pass brings in a layer at a time. A LoRA model (``Model.lora``) trains adapters
only: the frozen base weights are resident with the adapters beside them (in every copy,
trained or not: generation runs with them), gradients and Adam state are the adapters'.
A mixture-of-experts model holds every expert (split over ``ep`` ranks, or over ``tp``
when ``ep`` is 1) and computes with the active ones. FP8 models store inference weights
in one byte a value; trained FP8 models keep bf16 master weights (FP8 is a compute format).

ZeRO-2 is priced as the torch backend runs it (FSDP2 keeping the weights it gathered whole
between ops): beside them it keeps the float32 shards it updates — with float32 weights a
second copy (4/shards), with 16-bit weights the master weights (in the optimizer state) whose
gradients are float32 (4/shards). An optimizer with ``master_weights = false`` keeps 16-bit
moments and no master copy (2 + 2 B/parameter of state). Offloading the optimizer state of
16-bit FSDP2 shards (ZeRO 2-3) moves the moments; the float32 master shards, which FSDP2
updates in place, stay on the device unless the weights are offloaded too or the optimizer
runs on the host (DeepSpeed's CPU Adam).
"""

from __future__ import annotations

import functools
import math

import attrs

from rpeg.errors import CostError
from rpeg.graph.layout import Layout
from rpeg.spec.model import Cluster, Engine, GpuProfile, Head, Model, Zero
from rpeg.spec.presets import ModelDims

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "float16": 2, "bfloat16": 2, "fp32": 4, "float32": 4,
                "fp8": 1}


@attrs.frozen
class MemoryCost:
    """Bytes per GPU, by what they hold."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations
                + self.kv_cache + self.buffers)

    def __add__(self, other: MemoryCost) -> MemoryCost:
        return MemoryCost(self.weights + other.weights, self.grads + other.grads,
                          self.optimizer + other.optimizer,
                          self.activations + other.activations,
                          self.kv_cache + other.kv_cache, self.buffers + other.buffers)


def value_bytes(model: Model, gpu: GpuProfile) -> float:
    """Bytes per activation (and trained weight) value as the device runs this model (FP8
    models keep bf16 activations; their GEMMs run in FP8, see :func:`weight_bytes`)."""
    if gpu.compute_bytes:
        return gpu.compute_bytes
    try:
        return max(_DTYPE_BYTES[model.dtype], 2)
    except KeyError:
        raise CostError(f"model dtype must be one of {', '.join(_DTYPE_BYTES)}, "
                        f"not '{model.dtype}'", model.span) from None


def grad_reduce_bytes(param_bytes: float) -> float:
    """Bytes per gradient value as data-parallel ranks reduce them: the trained weights'
    own (``param_bytes``: bf16 on a GPU, float32 on a CPU), under DDP and FSDP2 alike (the
    torch backend's ``MixedPrecisionPolicy(reduce_dtype=...)`` takes its dtype from here;
    the float32 master weights are updated from the reduced gradients, as verl and NeMo
    RL offer with bf16 reduction). One rule, priced as run."""
    return param_bytes


def weight_bytes(model: Model, gpu: GpuProfile, trained: bool = False) -> float:
    """Bytes per weight as stored for passes: one for an FP8 model's inference copy."""
    if model.dtype == "fp8" and not trained and not gpu.compute_bytes:
        return 1.0
    return value_bytes(model, gpu)


def head_dims(model: Model) -> ModelDims:
    """The dimensions used to price the output head: a value/reward head emits one number."""
    if model.head is Head.LM:
        return model.dims
    return _scalar_head(model.dims)


@functools.lru_cache(maxsize=256)
def _scalar_head(dims: ModelDims) -> ModelDims:
    """``dims`` with a one-number head (made once per model: priced on every proposal)."""
    return attrs.evolve(dims, vocab=1)


def model_params(model: Model) -> int:
    """Parameters of the model with its head (an LM head, or a scalar value/reward head)."""
    d = model.dims
    if model.head is Head.LM:
        return d.param_count()
    return d.body_params() + d.vocab * d.hidden + d.hidden + d.hidden + 1 \
        + d.learned_positions * d.hidden


def lora_params(model: Model) -> int:
    """Parameters of the model's LoRA adapters (:meth:`rpeg.spec.training.Lora.params`)."""
    return model.lora.params(model.dims) if model.lora is not None else 0


def check_parallel(dims: ModelDims, par: Layout, where: str = "") -> None:
    """Raise CostError when the degrees cannot split this model."""
    at = f" for {where}" if where else ""
    for name in ("dp", "tp", "pp", "microbatches"):
        if getattr(par, name) < 1:
            raise CostError(f"{name} must be at least 1{at}, not {getattr(par, name)}")
    if dims.heads % par.tp:
        raise CostError(f"tp must divide the {dims.heads} attention heads{at}, not {par.tp}",
                        hint=f"use tp in {_divisors(dims.heads)}")
    if par.tp > dims.kv_heads and par.tp % dims.kv_heads:
        raise CostError(f"tp must divide or be a multiple of the {dims.kv_heads} KV heads{at}, "
                        f"not {par.tp}")
    if par.pp > dims.layers:
        raise CostError(f"pp must be at most the {dims.layers} layers{at}, not {par.pp}",
                        hint="lower pp, or use tp to split the model further")
    if par.cp < 1 or par.ep < 1:
        raise CostError(f"cp and ep must be at least 1{at}, not cp = {par.cp}, ep = {par.ep}")
    if par.ep > 1 and not dims.moe:
        raise CostError(f"ep must be 1 for a model without experts{at}, not {par.ep}")
    if par.ep > 1 and (dims.experts % par.ep or (par.dp * par.cp * par.tp) % par.ep):
        raise CostError(f"ep must divide the {dims.experts} experts and the dp x cp x tp = "
                        f"{par.dp * par.cp * par.tp} ranks that hold them{at}, not {par.ep}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


def local_params(model: Model, par: Layout) -> float:
    """Parameters on the busiest GPU: its layers' TP shard (experts: their EP shard, or TP
    shard without EP) plus the embedding/head share. A function of the model and of
    ``par``'s pp, tp and ep alone, kept per model (by identity: a model is not hashed
    again on every layout priced) and those three."""
    key = (id(model), par.pp, par.tp, par.ep)
    kept = _LOCAL.get(key)
    if kept is None or kept[0] is not model:
        if len(_LOCAL) > 4096:
            _LOCAL.clear()
        kept = _LOCAL[key] = (model, _local_params(model, par))
    return kept[1]


# (id of the model, pp, tp, ep) -> (the model, its local parameters): the model kept with
# its answer, so its id names no other while the entry is kept
_LOCAL: dict[tuple, tuple] = {}


def _local_params(model: Model, par: Layout) -> float:
    d = model.dims
    share = math.ceil(d.layers / par.pp) / d.layers
    experts = d.moe_layers * d.experts * d.mlp_params(d.expert_ffn)
    emb = model_params(model) - d.body_params()
    # With pp > 1 the first stage holds the embedding and the last the head; the busier
    # of the two holds about half the embedding parameters (all of them when tied).
    emb_here = emb if par.pp == 1 or d.tied_embeddings else emb / 2 + d.hidden
    return share * ((d.body_params() - experts) / par.tp
                    + experts / (par.ep if par.ep > 1 else par.tp)) + emb_here / par.tp


def resident_memory(model: Model, par: Layout, cluster: Cluster, *,
                    trained: bool, host_grads: bool = False,
                    engine: Engine | None = None) -> MemoryCost:
    """Bytes per GPU the model holds between stages (+ gradients and Adam state if trained).
    ``host_grads``: an offloaded optimizer whose gradients go to host memory as the backward
    pass makes them (DeepSpeed's ZeRO-Offload), so none stay on the device. ``engine``: the
    engine that trains it, which says both that and whether it frees its gradients after
    each step (``zero_grad(set_to_none=True)``: torch, FSDP), so they are not resident
    between steps but part of the train step's own peak (:func:`grads_between_steps`)."""
    check_parallel(model.dims, par, model.name)
    gpu = cluster.gpu
    if engine is not None:
        host_grads = host_grads or engine is Engine.DEEPSPEED
    n = local_params(model, par)
    shards = max(par.shards, 1)
    wb = weight_bytes(model, gpu, trained and model.lora is None)
    weights = 0.0 if par.param_offload else n * wb / (shards if par.zero.shards_params else 1)
    t = trained_local_params(model, par)
    bpv = value_bytes(model, gpu)
    if model.lora is not None:         # the adapters, beside the frozen backbone
        weights += t * bpv / (shards if par.zero.shards_params else 1)
    if not trained:
        return MemoryCost(weights=weights)
    extra, grads = grad_bytes(model, par, gpu, host_grads)
    weights += extra
    if engine is not None and not grads_between_steps(engine, gpu):
        grads = 0.0
    state = optimizer_state_bytes(model, par, gpu)
    if par.offload and not devices_are_host(gpu):
        state -= offloaded_bytes(model, par, gpu, host_optimizer=host_grads)
    return MemoryCost(weights=weights, grads=grads, optimizer=state)


def grad_bytes(model: Model, par: Layout, gpu: GpuProfile,
               host_grads: bool = False) -> tuple[float, float]:
    """(float32 weight shards kept beside them, gradient bytes) per GPU of a trained model
    once its backward pass has made them."""
    t = trained_local_params(model, par)
    bpv = value_bytes(model, gpu)
    shards = max(par.shards, 1)
    grads = 0.0 if par.param_offload or (host_grads and par.offload) \
        else t * bpv / (shards if par.zero.shards_grads else 1)
    extra = 0.0
    if par.zero.keeps_gathered and fsdp_runs(par.zero, shards, par.tp) and grads:
        # FSDP2: float32 shards beside the whole weights (module doc)
        if bpv >= 4:
            extra = t * 4 / shards
        elif _master(model):
            grads = t * 4 / shards
    return extra, grads


def fsdp_runs(zero: Zero, shards: int, tp: int) -> bool:
    """Whether FSDP2 runs a trained copy at ZeRO level ``zero`` sharded over ``shards``
    data-parallel ranks, ``tp`` tensor-parallel ranks each: at ZeRO 2-3, over more than
    one rank, or over one for its mixed precision where nothing else splits the model;
    with tensor parallelism and one data-parallel rank there is nothing to shard, and it
    runs as tensor parallelism alone. The runtime lays a trained copy out by it
    (``backends.torch_backend.sharding.TrainLayout.fsdp``), the cost model prices its
    float32 shards by it (:func:`grad_bytes`).

        >>> [fsdp_runs(z, n, tp) for z, n, tp in ((Zero.GRADIENTS, 1, 1), (Zero.WEIGHTS, 1, 2),
        ...                                         (Zero.WEIGHTS, 2, 2), (Zero.NONE, 8, 1))]
        [True, False, True, False]
    """
    return zero.shards_grads and (shards > 1 or tp == 1)


def grads_between_steps(engine: Engine, gpu: GpuProfile) -> bool:
    """Whether the gradients an engine trains with stay on the device between its steps:
    not for torch (FSDP2 and DDP as rpeg's backend and verl run them: set to None after
    each step), which makes them again in the next backward; yes for DeepSpeed (its
    partitioned gradient buffers) and Megatron (its contiguous gradient buffer)."""
    from rpeg.cost.engines import engine_terms
    return not engine_terms(engine, gpu).grads_freed


def trained_local_params(model: Model, par: Layout) -> float:
    """Parameters on the busiest GPU that the optimizer updates (a LoRA model's adapters)."""
    if model.lora is not None:
        return lora_params(model) * math.ceil(model.dims.layers / par.pp) \
            / model.dims.layers / par.tp
    return local_params(model, par)


def _master(model: Model) -> bool:
    return model.optimizer is None or model.optimizer.master


def optimizer_state_bytes(model: Model, par: Layout, gpu: GpuProfile) -> float:
    """Adam state per GPU: float32 master copy + two float32 moments (16-bit weights), the
    two moments (float32 weights), or two 16-bit moments (``master_weights = false``)."""
    n = trained_local_params(model, par)
    bpv = value_bytes(model, gpu)
    per = 8 if bpv >= 4 else (12 if _master(model) else 2 * bpv)
    return n * per / (par.shards if par.zero.shards_optimizer else 1)


def offloaded_bytes(model: Model, par: Layout, gpu: GpuProfile, *,
                    host_optimizer: bool = False) -> float:
    """What ``Layout.offload`` moves to host memory between train steps: the optimizer
    state, less FSDP2's float32 master shards (16-bit weights, ZeRO 2-3), which it updates
    in place on the device (unless ``param_offload`` keeps the weights on the host too, or
    ``host_optimizer``: Adam runs on the host, DeepSpeed's CPU Adam)."""
    state = optimizer_state_bytes(model, par, gpu)
    if par.zero.shards_grads and value_bytes(model, gpu) < 4 and _master(model) \
            and not par.param_offload and not host_optimizer:
        return state * 8 / 12
    return state


def devices_are_host(gpu: GpuProfile) -> bool:
    """Whether the devices' memory is the host's (a CPU profile: its devices are host cores),
    so offloading to host memory frees none of it."""
    return gpu.host_cores > 0


def usable_memory(gpu: GpuProfile) -> float:
    """Bytes per device a plan may fill: the capacity less the profile's ``reserve``.

    >>> usable_memory(GpuProfile("g", memory=80e9)) / 1e9                 # 10% by default
    72.0
    """
    return gpu.memory * (1.0 - gpu.reserve)


def with_reserve(cluster: Cluster, reserve: float | None) -> Cluster:
    """``cluster`` with ``reserve`` of each device's memory kept free (None: as it says)."""
    if reserve is None:
        return cluster
    if not 0 <= reserve < 1:
        raise CostError(f"memory reserve must be a share from 0 up to below 1, not {reserve:g}")
    return attrs.evolve(cluster, gpu=attrs.evolve(cluster.gpu, reserve=float(reserve)))


def fits(total_bytes: float, cluster: Cluster) -> bool:
    return total_bytes <= usable_memory(cluster.gpu)


def check_fits(total_bytes: float, cluster: Cluster, what: str) -> None:
    """Raise CostError when ``total_bytes`` per GPU exceeds what a plan may use of it."""
    cap = usable_memory(cluster.gpu)
    if total_bytes > cap:
        raise CostError(f"{what} must fit in {cap / 1e9:.0f} GB per GPU (its memory less "
                        f"the {cluster.gpu.reserve:.0%} reserve), not need "
                        f"{total_bytes / 1e9:.1f} GB",
                        hint="raise tp or pp, shard the optimizer (zero), add micro-batches "
                             "or recomputation, or place fewer models on these GPUs")
