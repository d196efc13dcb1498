"""Forward and train stages: passes over micro-batches, their communication, their memory.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> from rpeg.cost.topology import Topology
    >>> p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 4, 2)
    >>> m, w = p.model("actor"), p.workload
    >>> args = (m, Layout(dp=8, zero=3, microbatches=4), tuple(range(8)),
    ...         Topology.from_cluster(gh), gh.gpu, Engine.TORCH, w, 512, 2048.0)
    >>> c = train_cost(*args, opt_steps=4)
    >>> dict(c.breakdown)["zero3_gather"] > 0 and c.time_s > c.compute_s
    True

A batch is split into micro-batches (``microbatches`` a replica, per optimizer step for
training) of sequences padded to the batch's longest prompt and response, or, packed
(``packing``), of their real lengths: as many tokens as the sequences have, each query
attending to its own sequence (``E[S^2] / 2E[S]`` keys on average). Context parallelism
(``cp``) gives each rank a share of every sequence's tokens, exchanged with all-to-alls
around attention; a mixture of experts sends each token to its active experts and back
(all-to-alls over the expert-parallel group, priced at the level of the cluster they
span). Pipeline parallelism runs the micro-batches 1F1B.

ZeRO-3 (FSDP) gathers every layer's weights over the shard group (data x context parallel
ranks) in every micro-batch's forward, again in its backward (and recomputation), and
reduce-scatters its gradients. ZeRO-2, as the torch backend runs it (FSDP2 keeping the
gathered weights through the backward), gathers them once a micro-batch and
reduce-scatters its gradients, and gathers them whole once more after the op's last
optimizer step; ZeRO 0-1 reduce the gradients once per optimizer step.
How much of that traffic hides behind compute, and the host time of ZeRO-3's hooks per
parameter tensor, are the engine's (:mod:`rpeg.cost.engines`). Weights kept in host memory
(``param_offload``) are loaded for the stage and written back after it; an offloaded
optimizer state is streamed in and out once per train op (torch), or stays on the host
where the CPU runs Adam each optimizer step (DeepSpeed's CPU Adam).

Memory of a train micro-batch: the larger of its two phases, which are not alive at once.
At its loss, the activations of the micro-batches in flight (fewer with recomputation),
the output head's logits as the engine holds them and the float32 chunk its log-softmax
works on, and the gradients the micro-batches before it made (an engine that frees them
after each optimizer step makes them again from its first); in its backward pass, the
activations it frees as it goes while the gradients are made, the layer recomputed,
gradient buckets (the whole gradient for an all-reduce; two layers' for a
reduce-scatter) and the layers a ZeRO-3 pass gathers. What offloading brings in is alive
through both.
"""

from __future__ import annotations

import math

import attrs

from rpeg.cost import compute as C
from rpeg.cost.engines import LOGIT_WORK_COPIES, EngineTerms, engine_terms, with_terms
from rpeg.cost.generation import StageCost, gather_buffer, mean_len, padded_len, working_set
from rpeg.cost.memory import (
    MemoryCost,
    check_parallel,
    devices_are_host,
    fsdp_runs,
    grad_bytes,
    grad_reduce_bytes,
    head_dims,
    local_params,
    offloaded_bytes,
    trained_local_params,
    value_bytes,
    weight_bytes,
)
from rpeg.cost.topology import Collective, collective_time
from rpeg.graph.layout import Layout
from rpeg.spec.model import Engine, Model, Zero


@attrs.frozen
class Shape:
    """One micro-batch on one device."""

    rows: int             # sequences
    seq: float            # tokens a sequence has (padded, or the mean when packed)
    tokens: int           # tokens on this device (a 1/cp share)
    context: float        # keys a query attends to, on average
    head_tokens: int      # positions the output head scores on this device
    gen: float            # response tokens a sequence has


def shape(w, par: Layout, rows: int, gen: float) -> Shape:
    """The micro-batch of ``rows`` sequences whose responses have ``gen`` tokens: padded to
    it, or packed, their mean (:func:`rpeg.cost.stages.response_len`)."""
    if par.packing:
        (p, squares), g = _packed(w), gen
        seq = p + g
        context = (p * p + 2 * p * g + squares) / (2 * seq)
    else:
        p, g = padded_len(w.prompt_lens, rows), gen
        seq = p + g
        context = seq / 2
    return Shape(rows, seq, math.ceil(rows * seq / par.cp), context,
                 math.ceil(rows * g / par.cp), g)


def _packed(w) -> tuple[float, float]:
    """(the mean prompt length, the mean square of the response lengths) of workload ``w``
    a packed micro-batch's shape reads: kept per workload (by identity, each kept with its
    answer: asked of every layout priced)."""
    kept = _PACKED.get(id(w))
    if kept is None or kept[0] is not w:
        q = w.gen_len.quantiles(256)
        if len(_PACKED) > 256:
            _PACKED.clear()
        kept = _PACKED[id(w)] = (w, mean_len(w.prompt_lens), float((q * q).mean()))
    return kept[1], kept[2]


# id of a workload -> (the workload, its packed shape's terms): the workload kept with its
# answer, so its id names no other while the entry is kept
_PACKED: dict[int, tuple] = {}


# --- communication ----------------------------------------------------------------------------

def tp_group(devices, par: Layout) -> tuple[int, ...]:
    return tuple(devices[: par.tp])


def cp_group(devices, par: Layout) -> tuple[int, ...]:
    return tuple(devices[: par.cp * par.tp: par.tp])


def pp_group(devices, par: Layout) -> tuple[int, ...]:
    return tuple(devices[: par.pp * par.cp * par.tp: par.cp * par.tp])


def dp_group(devices, par: Layout, at: int = 0) -> tuple[int, ...]:
    """The data-parallel group of ``devices[at]``: the ranks holding the same model shard as
    it, every (pp x cp x tp)-th from its place in its block (the cost model's, and the torch
    backend's ``TrainLayout.dp_peers``).

        >>> dp_group((0, 1, 2, 3), Layout(dp=2, tp=2)), dp_group((0, 1, 2, 3), Layout(dp=2, tp=2), 3)
        ((0, 2), (1, 3))
    """
    stride = par.pp * par.cp * par.tp
    return tuple(devices[at % stride::stride])


def train_groups(world: tuple[int, ...], tp: int, zero: Zero) -> tuple[tuple[int, ...], ...]:
    """The process groups training a copy over ``world`` (dp x tp ranks, tp fastest) at
    ZeRO level ``zero`` takes, sorted: the whole world (its ranks checkpoint together; FSDP2
    shards over it at tp 1), each tensor-parallel block, and each data-parallel group where
    data parallelism spans blocks or FSDP2 runs (:func:`~rpeg.cost.memory.fsdp_runs`). The
    one rule the runtime creates them by (``rpeg.runtime.lowering.context.Replica``) and the
    torch backend's meshes use (``backends.torch_backend.sharding.mesh_groups``).

        >>> train_groups((0, 1, 2, 3), 2, Zero.NONE)
        ((0, 1), (0, 1, 2, 3), (0, 2), (1, 3), (2, 3))
        >>> train_groups((0, 1), 2, Zero.WEIGHTS)      # tp alone: FSDP2 does not run
        ((0, 1),)
    """
    par = Layout(dp=max(len(world) // max(tp, 1), 1), tp=max(tp, 1), zero=zero)
    fsdp = fsdp_runs(zero, par.dp, par.tp)
    out = set()
    if len(world) > 1 or fsdp:
        out.add(tuple(world))
    if par.tp > 1:
        out.update(tuple(world[i:i + par.tp]) for i in range(0, len(world), par.tp))
        if par.dp > 1 or fsdp:
            out.update(dp_group(world, par, t) for t in range(par.tp))
    return tuple(sorted(out))


def shard_group(devices, par: Layout) -> tuple[int, ...]:
    """The ranks ZeRO shards one model copy over: data and context parallel."""
    step = par.cp * par.tp
    if par.cp == 1:                          # every (pp x tp)-th rank, as one slice
        ranks = tuple(devices[::par.pp * par.tp][:par.dp])
        if len(ranks) == par.dp:
            return ranks
    return tuple(devices[(d * par.pp) * step + c * par.tp]
                 for d in range(par.dp) for c in range(par.cp))


def ep_group(devices, par: Layout) -> tuple[int, ...]:
    """The first ``ep`` of the ranks holding one pipeline stage's experts."""
    step = par.cp * par.tp
    ranks = [devices[(d * par.pp) * step + r] for d in range(par.dp) for r in range(step)]
    return tuple(ranks[: par.ep])


def layer_comm(model: Model, par: Layout, devices, topo, sh: Shape, bpv: float,
               layers: int, passes: int) -> float:
    """Seconds of one micro-batch's per-layer traffic on one device, over ``passes`` (1 a
    forward, 2 forward and backward): TP all-reduces (two a layer each pass, and one more
    for the vocabulary-split embedding's lookup forward, the split head's input gradient
    backward), CP all-to-alls, MoE dispatch and combine, the PP hand-over."""
    d = model.dims
    nbytes = sh.tokens * d.hidden * bpv
    t = (2 * layers + 1) * passes * collective_time(Collective.ALL_REDUCE, nbytes,
                                                    tp_group(devices, par), topo)
    if par.cp > 1:        # q, k, v and the output across the context-parallel group
        qkvo = sh.tokens * (2 * d.heads * d.head_dim + 2 * d.kv_dim) / par.tp * bpv
        t += passes * layers * collective_time(Collective.ALL_TO_ALL, qkvo,
                                               cp_group(devices, par), topo)
    if d.moe and par.ep > 1:     # tokens to their active experts and back
        moe_layers = layers * d.moe_layers / d.layers
        routed = sh.tokens * d.active_experts * d.hidden * bpv
        t += 2 * passes * moe_layers * collective_time(Collective.ALL_TO_ALL, routed,
                                                       ep_group(devices, par), topo)
    if par.pp > 1:
        t += passes * collective_time(Collective.P2P, nbytes, pp_group(devices, par)[:2], topo)
    return t


def exposed(comm: float, compute: float, overlap: float) -> float:
    """The part of ``comm`` that does not hide behind ``compute``: at least what exceeds it,
    and the share the engine does not overlap."""
    return max(comm - compute, comm * (1 - overlap)) if comm > 0 else 0.0


def zero3_gather(model: Model, par: Layout, devices, topo, gpu) -> float:
    """Seconds of one all-gather of a device's layers over the shard group (ZeRO-3)."""
    if not par.zero.shards_params:
        return 0.0
    return weights_gather(model, par, devices, topo, gpu)


def weights_gather(model: Model, par: Layout, devices, topo, gpu) -> float:
    """Seconds of one all-gather of a device's layers over the shard group (FSDP2: ZeRO-3
    before each pass, ZeRO-2 before each micro-batch)."""
    if par.shards <= 1:
        return 0.0
    full = local_params(model, attrs.evolve(par, zero=Zero.NONE)) * weight_bytes(model, gpu, True)
    return collective_time(Collective.ALL_GATHER, full, shard_group(devices, par), topo)


def host_bandwidth(gpu) -> float:
    """Bytes/s one way between a device and host memory (the profile's ``host_bandwidth``;
    PCIe Gen4 x16's achievable ~25 GB/s when a profile does not say)."""
    return gpu.host_bandwidth


# --- forward ----------------------------------------------------------------------------------

def _pass(model: Model, par: Layout, gpu, t: EngineTerms, sh: Shape,
          layers: int, head: bool = True) -> C.PassCost:
    """One forward of a micro-batch of shape ``sh`` over ``layers`` layers, with the output
    head and what its logits go through, or (``head`` False: activation recomputation,
    which runs the checkpointed layers again, not the head) without."""
    hd = head_dims(model)
    wb = weight_bytes(model, gpu)
    pc = C.pass_cost(hd, with_terms(gpu, t), tokens=max(sh.tokens, 1), context=sh.context,
                     bytes_per_value=value_bytes(model, gpu), tp=par.tp, layers=layers,
                     head=head, head_tokens=max(sh.head_tokens, 1), ep=par.ep,
                     weight_bytes=wb if wb != value_bytes(model, gpu) else None,
                     logit_bytes=t.loss.forward(value_bytes(model, gpu)))
    if par.packing and gpu.packed_seq_overhead:
        # packed rows where the device has no variable-length attention kernel: one
        # attention call per sequence per layer (backends.torch_backend.attention)
        pc = attrs.evolve(pc, time_s=pc.time_s + sh.rows * layers * gpu.packed_seq_overhead)
    return pc


def _loss_backward(model: Model, par: Layout, gpu, t: EngineTerms, sh: Shape, back: float,
                   roof_back: float) -> C.PassCost:
    """What a micro-batch's backward through its log-probabilities costs beyond ``back``
    times their forward (the time) and ``roof_back`` times (the traffic), where the engine
    counts that backward apart (:meth:`rpeg.cost.engines.LossTraffic.backward`; else
    nothing): negative where it moves less than that many forwards."""
    bpv = value_bytes(model, gpu)
    bwd = t.loss.backward(bpv)
    if bwd is None:
        return C.PassCost(0.0, C.Roof())
    logits = max(sh.head_tokens, 1) * head_dims(model).vocab / par.tp
    g = with_terms(gpu, t)
    fwd = t.loss.forward(bpv)
    return C.PassCost(logits * (bwd - back * fwd) / (g.elem_bandwidth or g.mem_bandwidth),
                      C.Roof(0.0, logits * (bwd - roof_back * fwd)))


def forward_cost(model: Model, par: Layout, devices, topo, gpu, engine: Engine, w,
                 batch: int, gen: float) -> StageCost:
    """One forward pass over the batch (no gradients), in micro-batches."""
    check_parallel(model.dims, par, model.name)
    t = engine_terms(engine, gpu)
    bpv = value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    m = min(par.microbatches, local)
    layers = math.ceil(model.dims.layers / par.pp)
    sh = shape(w, par, math.ceil(local / m), gen)
    one = _pass(model, par, gpu, t, sh, layers)
    fwd = one.time_s
    gather = zero3_gather(model, par, devices, topo, gpu)
    hooks = C.param_tensors(model.dims, layers) * t.hook_s if gather else 0.0
    z3 = exposed(gather, fwd, t.overlap) + hooks
    pipe = m + par.pp - 1
    compute = pipe * fwd + local * gpu.sample_overhead
    comm = pipe * (layer_comm(model, par, devices, topo, sh, bpv, layers, 1) + z3)
    load = local_params(model, par) * weight_bytes(model, gpu) / host_bandwidth(gpu) \
        if par.param_offload else 0.0
    return StageCost(compute + comm + load, compute, comm + load,
                     (("forward", compute), ("tp+pp", comm - pipe * z3),
                      ("zero3_gather", pipe * z3), ("offload", load)), one.roof.scaled(m))


# --- train ------------------------------------------------------------------------------------

def train_cost(model: Model, par: Layout, devices, topo, gpu, engine: Engine, w, batch: int,
               gen: float, opt_steps: int, off_policy: bool = False) -> StageCost:
    """``opt_steps`` optimizer steps over the batch: forward + backward (+ recomputation) of
    micro-batches in a 1F1B pipeline, their traffic, gradient reduction, Adam."""
    check_parallel(model.dims, par, model.name)
    t = engine_terms(engine, gpu)
    d, bpv = model.dims, value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    per_step = max(math.ceil(local / opt_steps), 1)
    m = min(par.microbatches, per_step)
    layers = math.ceil(d.layers / par.pp)
    sh = shape(w, par, math.ceil(per_step / m), gen)
    one = _pass(model, par, gpu, t, sh, layers)
    fwd = one.time_s
    # backward: activation and weight gradients; a LoRA model's frozen weights need none,
    # leaving about the activation-gradient half (the adapters' own GEMMs are rank-thin)
    half = 0.5 if model.lora is not None else 1.0
    back = gpu.backward_factor * half
    passes = 1 + back + (1 if par.recompute else 0)
    # the backward's GEMMs do twice the forward's FLOPs (``backward_factor`` >= 2 is its time)
    work_passes = 1 + 2 * half
    # recomputation runs the checkpointed layers' forward again, not the head
    again = _pass(model, par, gpu, t, sh, layers, head=False) if par.recompute \
        else C.PassCost(0.0, C.Roof())
    # an engine that counts its log-probabilities' backward traffic apart (rpeg's backend:
    # LossTraffic) pays that, not backward_factor times the forward's
    loss_back = _loss_backward(model, par, gpu, t, sh, back, 2 * half)
    mb = fwd * (1 + back) + again.time_s + loss_back.time_s
    gather = zero3_gather(model, par, devices, topo, gpu)
    hooks = C.param_tensors(d, layers) * t.hook_s if gather else 0.0
    trained = trained_local_params(model, par) * grad_reduce_bytes(bpv)   # gradients reduced
    shards = shard_group(devices, par)
    if gather:       # gathered for the forward, the backward (and recomputation), grads scattered
        moved = gather * (passes - back + 1) + collective_time(
            Collective.REDUCE_SCATTER, trained, shards, topo)
        # hooks: the forward's (and recomputation's) gathers, the backward's gather and
        # gradient hook on every tensor
        z3 = exposed(moved, mb, t.overlap) + hooks * (passes - back + 1) \
            + C.param_tensors(d, layers) * t.grad_hook_s
        dp_comm = 0.0
    elif par.zero.keeps_gathered and par.shards > 1:
        # FSDP2 (module doc): a gather and a reduce-scatter each micro-batch, hidden behind
        # its forward and backward as far as the engine overlaps them; the gather after the
        # op's last step, once (dp_comm is per optimizer step)
        regather = weights_gather(model, par, devices, topo, gpu)
        moved = regather + collective_time(Collective.REDUCE_SCATTER, trained, shards, topo)
        z3 = exposed(moved, mb, t.overlap)
        dp_comm = regather / opt_steps
    else:            # ZeRO 0-1: the gradients all-reduced once per optimizer step
        z3 = 0.0
        dp_comm = exposed(collective_time(Collective.ALL_REDUCE, trained, shards, topo), 0.0,
                          t.overlap)
    pipe = m + par.pp - 1
    fb = pipe * mb
    comm_layers = pipe * layer_comm(model, par, devices, topo, sh, bpv, layers, 2)
    shard = par.shards if par.zero.shards_optimizer else 1
    n_opt = trained_local_params(model, par) / shard
    opt = C.optimizer_time(n_opt, C.param_tensors(d, layers), gpu)
    if par.shards > 1:
        # a data-parallel rank's host work per tensor per step, more with FSDP2's sharded
        # parameters (a CPU profile measures both on two worker ranks; 0 elsewhere)
        opt += C.param_tensors(d, layers) * (gpu.dp_tensor_overhead + (
            gpu.shard_tensor_overhead if par.zero.shards_grads else 0.0))
    host = per_step * gpu.sample_overhead
    if par.shards > 1 and par.zero.shards_grads:
        # FSDP2's calls per layer per micro-batch (gather, reshard, reduce-scatter) beyond
        # the bytes priced above (a CPU profile measures them on two worker ranks; 0
        # elsewhere)
        host += pipe * layers * gpu.shard_layer_overhead
    compute = opt_steps * (fb + host)
    comm = opt_steps * (comm_layers + dp_comm + pipe * z3)
    offload = offload_time(model, par, gpu, engine, opt_steps)
    if offload and engine is Engine.DEEPSPEED:
        opt = 0.0                               # Adam runs on the host, in offload_time
    compute += opt_steps * opt
    comm += offload
    # the off-policy correction's forward: the whole local batch once, no gradients
    prox = opt_steps * pipe * fwd if off_policy else 0.0
    prox_comm = opt_steps * comm_layers / 2 if off_policy else 0.0
    compute += prox
    comm += prox_comm
    roof = one.roof.scaled(opt_steps * m * (work_passes + (1 if off_policy else 0))) \
        + (loss_back.roof + again.roof).scaled(opt_steps * m) \
        + C.Roof(0.0, opt_steps * C.optimizer_bytes(n_opt) if opt else 0.0)
    return StageCost(compute + comm, compute, comm,
                     (("proximal_forward", prox + prox_comm),
                      ("forward+backward", opt_steps * fb), ("optimizer", opt_steps * opt),
                      ("host", opt_steps * host), ("tp+pp", opt_steps * comm_layers),
                      ("dp_grad_reduce", opt_steps * dp_comm),
                      ("zero3_gather" if par.zero.shards_params else "zero2_gather",
                       opt_steps * pipe * z3), ("offload", offload)), roof)


def offload_time(model: Model, par: Layout, gpu, engine: Engine = Engine.TORCH,
                 opt_steps: int = 1) -> float:
    """Seconds a train op spends on state kept in host memory: the optimizer state brought
    in and written back once (torch), or every optimizer step the gradients sent to the
    host, Adam run there and the weights brought back (DeepSpeed's CPU Adam,
    :func:`cpu_adam_step`); the weights and gradients of a ``param_offload`` stage loaded and
    written back once."""
    bw = host_bandwidth(gpu)
    t = 0.0
    if par.offload and engine is Engine.DEEPSPEED:
        t += opt_steps * cpu_adam_step(model, par, gpu)
    elif par.offload:
        t += 2 * offloaded_bytes(model, par, gpu) / bw
    if par.param_offload:
        shards = par.shards if par.zero.shards_params else 1
        t += 2 * 2 * local_params(model, par) * value_bytes(model, gpu) / shards / bw
    return t


ADAM_HOST_BYTES = 28.0     # CPU Adam per parameter: reads fp32 weight, gradient, two moments;
#                            writes weight and moments (4 x 4 + 3 x 4)
CLIP_HOST_BYTES = 8.0      # the fp32 gradient unscaled and clipped in place (read, write)


def cpu_adam_step(model: Model, par: Layout, gpu) -> float:
    """Seconds of one optimizer step of DeepSpeed's ZeRO-Offload (``offload`` on a DeepSpeed
    train stage: the optimizer state and its step on the host) for the rank's share of the
    trained parameters, as ``deepspeed/runtime/zero/stage_1_and_2.py`` runs it (v0.13-v0.14;
    ``stage3.py`` sends the gradients the same way):

    - the gradients are widened on the device (``src_tensor.float()``) and sent to the host
      at 4 bytes a value;
    - the host unscales and clips them in place (``unscale_and_clip_grads``: a ``mul_`` over
      the float32 gradient, 8 bytes read and written);
    - CPU Adam updates the float32 weights and moments (28 bytes);
    - the float32 weights are copied into the device's 16-bit copy, which PyTorch converts on
      the CPU before the transfer (read 4, write 2 bytes there) and sends at 2 bytes.

    Host traffic runs at ``host_memory_bandwidth``, the host's streaming rate for one rank's
    step (a Ray worker with ``num_cpus = 1``, as OpenRLHF places its models, runs DeepSpeed's
    OpenMP CPU Adam and torch's CPU ops on one thread: Ray sets ``OMP_NUM_THREADS`` to the
    actor's CPUs); the transfers at ``host_bandwidth``."""
    n = trained_local_params(model, par) / (par.shards if par.zero.shards_optimizer else 1)
    vb = value_bytes(model, gpu)
    back = 4.0 + vb if vb < 4 else 0.0             # 16-bit weights: converted on the host
    host = n * (CLIP_HOST_BYTES + ADAM_HOST_BYTES + back) / gpu.host_memory_bandwidth
    return host + n * (4.0 + vb) / host_bandwidth(gpu)


# --- memory -----------------------------------------------------------------------------------

def activation_bytes_per_token(model: Model, par: Layout, seq: int, bpv: float,
                               sequence_parallel: bool = False) -> float:
    """Values autograd keeps per token per layer for the backward pass, in bytes.

    Counted for a Llama block: norm inputs/outputs (3h each of two), q/k/v and rotated
    q/k, the attention output and o_proj input, gate, up, SiLU(gate) and the product
    (4 ffn; a mixture of experts: of its active experts); attention itself is fused (no
    S x S scores kept). With sequence parallelism the TP ranks split the norms' and the
    residual stream's values too.
    """
    d, tp = model.dims, par.tp
    hidden = d.hidden / tp if sequence_parallel else d.hidden
    kv = max(d.kv_dim // tp, d.head_dim)
    q = d.heads * d.head_dim
    width = d.ffn
    if d.moe:
        share = d.moe_layers / d.layers
        width = (1 - share) * d.ffn + share * d.expert_ffn * (d.active_experts
                                                              + d.shared_experts)
    values = 6 * hidden + (q // tp + 2 * kv) + (q // tp + kv) \
        + 2 * d.hidden // tp + (4 if d.gated else 2) * width / tp
    return values * bpv


def logits_bytes(model: Model, par: Layout, tokens: float, t: EngineTerms,
                 train: bool = False) -> float:
    """The output head's logits for ``tokens`` positions as the engine holds them (its bytes
    per logit, with their gradient when training; in chunks of ``logits_chunk`` where it
    computes them so), and the float32 chunk a chunked log-softmax works on
    (``logits_work`` values, :data:`~rpeg.cost.engines.LOGIT_WORK_COPIES` copies)."""
    n = min(tokens, t.logits_chunk) if t.logits_chunk else tokens
    values = n * head_dims(model).vocab / par.tp
    work = min(values, t.logits_work) * 4 * LOGIT_WORK_COPIES if t.logits_work else 0.0
    return values * (t.logits_train if train else t.logits_fwd) + work


def forward_memory(model: Model, par: Layout, gpu, engine: Engine, w, batch: int,
                   gen: float) -> MemoryCost:
    """A forward stage's transient bytes per GPU: the residual stream, the larger of a
    layer's intermediates and the head's logits, gathered ZeRO-3 layers, loaded weights."""
    check_parallel(model.dims, par, model.name)
    t = engine_terms(engine, gpu)
    bpv = value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    sh = shape(w, par, math.ceil(local / par.microbatches), gen)
    stream = sh.tokens * model.dims.hidden * bpv
    buf = stream + max(working_set(model, par, sh.tokens, bpv),
                       logits_bytes(model, par, sh.head_tokens, t))
    buf += gather_buffer(model, par, gpu, engine)
    loaded = local_params(model, par) * weight_bytes(model, gpu) \
        / (par.shards if par.zero.shards_params else 1) if par.param_offload else 0.0
    return MemoryCost(weights=loaded, buffers=gpu.runtime_memory + buf)


def train_memory(model: Model, par: Layout, gpu, engine: Engine, w, batch: int, gen: float,
                 minibatches: int) -> MemoryCost:
    """A train stage's transient bytes per GPU: the larger of its two phases
    (:func:`train_phases`)."""
    return max(train_phases(model, par, gpu, engine, w, batch, gen, minibatches),
               key=lambda m: m.total)


def train_phases(model: Model, par: Layout, gpu, engine: Engine, w, batch: int, gen: float,
                 minibatches: int) -> tuple[MemoryCost, MemoryCost]:
    """A train stage's transient bytes per GPU at a micro-batch's loss (the activations of
    the micro-batches in flight, 1F1B: up to pp on the first stage; the logits; the
    gradients of the micro-batches before it) and in its backward pass (the activations as
    they are freed and the gradients as they are made, gradient buckets, gathered layers),
    each with the state offloading brings in for the step (module doc)."""
    check_parallel(model.dims, par, model.name)
    t = engine_terms(engine, gpu)
    d, bpv = model.dims, value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    layers = math.ceil(d.layers / par.pp)
    sh = shape(w, par, math.ceil(local / minibatches / par.microbatches), gen)
    in_flight = min(par.pp, par.microbatches)
    per_layer = activation_bytes_per_token(model, par, int(sh.seq), bpv,
                                           t.sequence_parallel) * gpu.act_factor
    stream = d.hidden / (par.tp if t.sequence_parallel else 1)
    # kept: what the backward pass frees as it goes (each layer's input under recompute, its
    # activations otherwise); working: the layer recomputed for its backward, held whole
    if par.recompute:
        kept, working = sh.tokens * in_flight * layers * stream * bpv, sh.tokens * per_layer
    else:
        kept, working = sh.tokens * in_flight * layers * per_layer, 0.0
    loss = logits_bytes(model, par, sh.head_tokens, t, train=True)
    full = trained_local_params(model, par) * bpv
    grads = 0.0
    if t.grads_freed:
        # Gradients are dropped after each step (zero_grad(set_to_none)), so they are not
        # resident (rpeg.cost.memory.grads_between_steps), and made again while the
        # backward pass frees the kept activations: the two share the backward's peak,
        # beside the layer being recomputed.
        grads = grad_bytes(model, par, gpu, engine is Engine.DEEPSPEED)[1]
    # at a micro-batch's loss: the gradients of the ones before it in the optimizer step
    before = grads if par.microbatches > 1 else 0.0
    if par.shards <= 1:
        bucket = 0.0
    elif par.zero.shards_grads:  # reduce-scatter buckets: about two layers' gradients
        bucket = min(full, 2 * full / max(layers, 1))
    else:                        # an all-reduce of the whole flat gradient
        bucket = full
    state = offloaded_bytes(model, par, gpu) \
        if par.offload and engine is not Engine.DEEPSPEED and not devices_are_host(gpu) \
        else 0.0
    loaded = 0.0
    if par.param_offload:
        shards = par.shards if par.zero.shards_params else 1
        loaded = 2 * local_params(model, par) * bpv / shards
    at_loss = MemoryCost(activations=kept, optimizer=state, weights=loaded, grads=before,
                         buffers=gpu.runtime_memory + loss)
    backward = MemoryCost(activations=max(kept - grads, 0.0) + working, optimizer=state,
                          weights=loaded, grads=grads,
                          buffers=gpu.runtime_memory + bucket
                          + gather_buffer(model, par, gpu, engine)
                          + working_set(model, par, sh.tokens, bpv))
    return at_loss, backward


__all__ = ["Shape", "activation_bytes_per_token", "cpu_adam_step", "dp_group", "forward_cost",
           "forward_memory", "host_bandwidth", "offload_time", "pp_group", "shape", "tp_group",
           "train_cost", "train_memory", "train_phases"]
