"""The checked, resolved meaning of a .rpeg file: what every later layer reads.

    >>> from rpeg.spec import load
    >>> p = load("pipelines/ppo_llama8b.rpeg")             # doctest: +SKIP
    >>> p.stage("rollout").kind, p.staleness_of("rollout")  # doctest: +SKIP
    (<OpKind.GENERATE: 'generate'>, 1)

The parser builds a syntax tree (``rpeg.spec.ast``); ``rpeg.spec.lower`` checks
it and produces these frozen values. Quantities are in SI base units: bytes,
bytes per second, FLOP/s, seconds.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterator

import attrs
import numpy as np

from rpeg.errors import NOWHERE, Span
from rpeg.spec.functions import function
from rpeg.spec.kinds import GENERATE_ENGINES as GENERATE_ENGINES  # re-exported
from rpeg.spec.kinds import PASS_ENGINES as PASS_ENGINES  # re-exported
from rpeg.spec.kinds import Engine, Head, OpKind, Zero
from rpeg.spec.kinds import zero_levels as zero_levels  # re-exported
from rpeg.spec.paths import FileRef
from rpeg.spec.presets import ModelDims
from rpeg.spec.training import (
    Evaluation,
    Fields,
    Logging,
    Lora,
    RewardForm,
    Template,
    Truncation,
)


class DType(enum.StrEnum):
    """The type a model's parameters are stored and computed in."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"


class LengthKind(enum.Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"
    EMPIRICAL = "empirical"


# Data every pipeline has without a stage producing it.
WORKLOAD_DATA = ("prompts",)


@attrs.frozen(cache_hash=True)       # a key of the cost model's memos: hashed once
class LengthDist:
    """Distribution of generated lengths, in tokens. Always bounded by ``max_len``."""

    kind: LengthKind
    max_len: int
    median: float = 0.0            # lognormal
    sigma: float = 0.0             # lognormal; derived from median and max when not given
    low: int = 0                   # uniform
    bins: tuple[tuple[int, float], ...] = ()   # empirical: (length, weight)
    source: str | None = None      # empirical: the histogram file
    top: int = 0                   # uniform: its upper end, when a generate stage's max_len
                                   # caps it below (max_len is then the cap)
    floor: int = 0                 # a generate stage's min_len: no response is shorter

    def capped(self, low: int, high: int) -> LengthDist:
        """The lengths a generate stage with ``min_len = low`` and ``max_len = high`` gives."""
        changes: dict = {}
        if high < self.max_len:
            changes["max_len"] = high
            if self.kind is LengthKind.UNIFORM:
                changes["top"] = self.top or self.max_len
        if low > max(self.floor, 1):
            changes["floor"] = min(low, changes.get("max_len", self.max_len))
        return attrs.evolve(self, **changes) if changes else self

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls(LengthKind.FIXED, max_len=n)

    def quantiles(self, n: int = 64) -> np.ndarray:
        """``n`` lengths at evenly spaced quantiles (midpoints): a deterministic sample
        (read-only: computed once per distribution and ``n``, the cost model asks often)."""
        return _quantiles(self, n)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` random lengths (integers in [1, max_len])."""
        if self.kind is LengthKind.FIXED:
            out = np.full(n, self.max_len)
        elif self.kind is LengthKind.UNIFORM:
            out = rng.integers(self.low, (self.top or self.max_len) + 1, size=n)
        elif self.kind is LengthKind.LOGNORMAL:
            out = np.round(self.median * np.exp(self.sigma * rng.standard_normal(n)))
        else:
            lengths = np.array([b[0] for b in self.bins])
            weights = np.array([b[1] for b in self.bins], dtype=float)
            out = rng.choice(lengths, size=n, p=weights / weights.sum())
        return np.clip(out, max(self.floor, 1), self.max_len).astype(int)

    def mean(self) -> float:
        return float(self.quantiles(256).mean())

    def __str__(self) -> str:
        return self._text() + (f", at least {self.floor}" if self.floor > 1 else "")

    def _text(self) -> str:
        if self.kind is LengthKind.FIXED:
            return str(self.max_len)
        if self.kind is LengthKind.UNIFORM:
            if self.top:
                return f"uniform(min = {self.low}, max = {self.top}) capped at {self.max_len}"
            return f"uniform(min = {self.low}, max = {self.max_len})"
        if self.kind is LengthKind.LOGNORMAL:
            return f"lognormal(median = {_num(self.median)}, max = {self.max_len}, sigma = {_num(self.sigma)})"
        return f"empirical({self.source!r}, max = {self.max_len})"


def lognormal_sigma(median: float, max_len: int) -> float:
    """Default spread: ``max`` sits at the 99.9th percentile (z = 3.09)."""
    if max_len <= median:
        return 0.0
    return math.log(max_len / median) / 3.09



@functools.lru_cache(maxsize=1024)
def _quantiles(dist: LengthDist, n: int) -> np.ndarray:
    q = (np.arange(n) + 0.5) / n
    if dist.kind is LengthKind.FIXED:
        out = np.full(n, float(dist.max_len))
    elif dist.kind is LengthKind.UNIFORM:
        out = dist.low + q * ((dist.top or dist.max_len) - dist.low)
    elif dist.kind is LengthKind.LOGNORMAL:
        from statistics import NormalDist
        z = np.array([NormalDist().inv_cdf(float(x)) for x in q])
        out = dist.median * np.exp(dist.sigma * z)
    else:
        lengths = np.array([b[0] for b in dist.bins], dtype=float)
        weights = np.array([b[1] for b in dist.bins], dtype=float)
        order = np.argsort(lengths)
        cdf = np.cumsum(weights[order]) / weights.sum()
        out = lengths[order][np.searchsorted(cdf, q, side="left").clip(0, len(lengths) - 1)]
    out = np.clip(np.round(out), max(dist.floor, 1), dist.max_len)
    out.flags.writeable = False
    return out

CHECKPOINT_EVERY = 10        # a workload's checkpoint_every when it sets none (steps)
KEEP_CHECKPOINTS = 2         # complete checkpoints a run keeps when it sets none


@attrs.frozen
class Workload:
    steps: int
    prompts: int                  # prompts per step
    samples: int                  # responses per prompt (GRPO: > 1)
    prompt_len: int
    gen_len: LengthDist
    dataset: FileRef | None = None            # resolved where written (rpeg.spec.paths)
    seed: int = 0
    span: Span = NOWHERE
    fields: Fields = Fields()                 # which columns are the prompt and the answer
    template: Template = Template.AUTO        # chat template or raw text
    split: str | None = None                  # a saved DatasetDict's split
    prompt_dist: LengthDist | None = None     # the prompts' lengths (None: all prompt_len)
    truncation: Truncation = Truncation.ERROR  # a prompt over prompt_len: refused, or cut
    checkpoint_every: int = CHECKPOINT_EVERY  # steps between a run's cuts (0: eval steps, end)
    keep_checkpoints: int = KEEP_CHECKPOINTS  # the newest complete ones kept (0: every one)
    # where each key was written (for errors about the data it names)
    keys: tuple[tuple[str, Span], ...] = attrs.field(default=(), eq=False, repr=False)

    def span_of(self, key: str) -> Span:
        return dict(self.keys).get(key, self.span)

    @property
    def batch(self) -> int:
        """Responses per step."""
        return self.prompts * self.samples

    @property
    def prompt_lens(self) -> LengthDist:
        """The prompts' lengths, at most ``prompt_len`` (the longest a prompt is cut to)."""
        return self.prompt_dist or LengthDist.fixed(self.prompt_len)


@attrs.frozen
class Optimizer:
    """A model's optimizer (``rpeg.spec.functions``: adam, adamw) and its schedule."""

    kind: str                       # an optimizer of the registry: its names are the modes
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip: float = 1.0
    master: bool = True           # 16-bit weights: Adam updates float32 master copies
    schedule: str = "constant"      # learning rate after warmup: constant, linear, cosine
    warmup: int = 0                 # steps of linear warmup
    min_lr: float = 0.0             # where a decaying schedule ends


@attrs.frozen
class Model:
    name: str
    preset: str
    dims: ModelDims
    head: Head = Head.LM
    frozen: bool = False
    optimizer: Optimizer | None = None
    dtype: DType = attrs.field(default=DType.BF16, converter=DType)
    weights: str | None = None      # a local weights folder's absolute path (safetensors +
                                    # config), resolved where written (rpeg.spec.paths)
    span: Span = NOWHERE
    lora: Lora | None = None        # low-rank adapters train; the backbone stays frozen

    @property
    def trainable(self) -> bool:
        return not self.frozen


@attrs.frozen
class Reward:
    """``reward NAME = KIND(...)``: ``python("module:function")``, or a built-in kind (with
    its keywords in ``params``, as in ``rpeg.spec.functions``)."""

    name: str
    module: str                   # a reward running the user's code: its module and function
    function: str
    span: Span = NOWHERE
    kind: str = ""                # the reward kind of the registry
    params: tuple[tuple[str, object], ...] = ()
    source: str = ""              # the module's file, found when the spec was loaded
    folder: str = ""              # the folder of the file naming it: imported from there
    form: RewardForm = RewardForm.BATCH      # a python reward: how it is called
    columns: tuple[str, ...] = ()            # ... the columns it needs by name (no default)

    @property
    def on_error(self) -> str:
        """What a failing call does: stop the run, or score 0 (python rewards)."""
        return str(dict(self.params).get("on_error", "stop"))

    def __str__(self) -> str:
        if self.module:
            return f'{self.kind}("{self.module}:{self.function}")'
        return f"{self.kind}({', '.join(f'{k} = {v}' for k, v in self.params)})"


@attrs.frozen
class Stage:
    """One stage of an RL step: ``stage NAME = FUNCTION(target, inputs..., k = v) -> outputs``."""

    name: str
    kind: OpKind
    function: str                 # generate, forward, score, train, gae, group_norm, ...
    target: str | None            # the model (or reward) the stage runs; None for pure compute
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[tuple[str, object], ...] = ()
    span: Span = NOWHERE

    def param(self, key: str, default: object = None) -> object:
        for k, v in self.params:
            if k == key:
                return v
        return default

    def arg(self, key: str) -> object:
        """A keyword's value as written, else its default in the registry
        (``rpeg.spec.functions``; None where the default is off or derived elsewhere)."""
        for k, v in self.params:
            if k == key:
                return v
        p = function(self.function).param(key)
        return None if p.derived else p.default


@attrs.frozen
class Pin:
    """``place STAGE on gpus A..B { dp = 2; tp = 1; zero = 3; recompute; ... }``: the
    stage's devices, and whichever parts of its layout the block names (the rest is
    searched). ``keys`` says where each pinned key was written, for errors."""

    stage: str
    first: int
    last: int
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: Zero | None = attrs.field(default=None, converter=Zero.maybe)
    recompute: bool | None = None
    offload: bool | None = None
    microbatches: int | None = None
    engine: Engine | None = None
    chunks: int | None = None
    cp: int | None = None
    ep: int | None = None
    packing: bool | None = None
    param_offload: bool | None = None
    max_num_seqs: int | None = None
    kv_fraction: float | None = None
    cuda_graph: bool | None = None
    span: Span = attrs.field(default=NOWHERE, eq=False)
    keys: tuple[tuple[str, Span], ...] = attrs.field(default=(), eq=False)

    LAYOUT = ("dp", "tp", "pp", "zero", "recompute", "offload", "microbatches", "engine",
              "chunks", "cp", "ep", "packing", "param_offload", "max_num_seqs", "kv_fraction",
              "cuda_graph")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    @property
    def sharded(self) -> bool:
        """The block pins a ZeRO level that shards something (on a forward or generate
        stage: a pass on sharded weights)."""
        return self.zero is not None and not self.zero.replicated

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.last + 1))

    def pinned(self) -> tuple[tuple[str, object], ...]:
        """(key, value) of every layout key the pin fixes, in ``LAYOUT`` order."""
        return tuple((k, getattr(self, k)) for k in self.LAYOUT if getattr(self, k) is not None)

    def span_of(self, key: str) -> Span:
        return dict(self.keys).get(key, self.span)


@attrs.frozen
class Pipeline:
    name: str
    path: str
    workload: Workload
    models: tuple[Model, ...]
    rewards: tuple[Reward, ...]
    stages: tuple[Stage, ...]
    staleness: tuple[tuple[str, int], ...] = ()        # (stage, bound)
    shares: tuple[tuple[str, ...], ...] = ()           # groups allowed to share a backbone
    colocate: tuple[tuple[str, ...], ...] = ()         # stages or models pinned together
    place: tuple[Pin, ...] = ()                         # pinned devices and layouts
    extends: tuple[str, ...] = ()                      # resolved paths, nearest first
    evaluation: Evaluation | None = None               # held-out prompts every N steps
    log: Logging = Logging()                           # trackers, sampled responses kept
    tools: tuple = ()          # rpeg.spec.tools.Tool: the tools and environments declared

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def reward(self, name: str) -> Reward:
        return next(r for r in self.rewards if r.name == name)

    def tool(self, name: str):
        """The tool or environment declared as ``name`` (``rpeg.spec.tools.Tool``)."""
        return next(t for t in self.tools if t.name == name)

    def has_model(self, name: str) -> bool:
        return any(m.name == name for m in self.models)

    def staleness_of(self, stage: str) -> int:
        return dict(self.staleness).get(stage, 0)

    def producer(self, data: str) -> Stage | None:
        return next((s for s in self.stages if data in s.outputs), None)

    def trainers(self, model: str) -> Iterator[Stage]:
        return (s for s in self.stages if s.kind is OpKind.TRAIN and s.target == model)

    def pin(self, stage: str) -> Pin | None:
        return next((p for p in self.place if p.stage == stage), None)


class Level(enum.IntEnum):
    """Levels of the cluster tree; a link at level L joins units of level L - 1."""

    GPU = 0     # the GPU-to-GPU link inside a node (NVLink, or shared memory on CPU)
    NODE = 1    # between nodes of one rack
    RACK = 2    # between racks


@attrs.frozen
class Link:
    level: Level
    bandwidth: float      # bytes/s, one direction, per GPU
    latency: float        # seconds
    span: Span = NOWHERE


def _q(unit: str, default: float = 0.0):
    return attrs.field(default=default, metadata={"unit": unit})


def _m(unit: str, default: float | None = 0.0):
    """A figure a calibration (or a benchmark) measures, printed only where it was."""
    return attrs.field(default=default, metadata={"unit": unit, "measured": True})


@attrs.frozen(cache_hash=True)       # a key of the cost model's memos: hashed once
class GpuProfile:
    """What the cost model knows of one device: measured where it can be, cited where not.

    Every numeric field has a unit in its metadata; the cluster language sets
    any of them by name (``memory = 96 GB``), and a key that is none of them is an
    error. The fields after ``source`` are what ``rpeg calibrate`` (or a benchmark)
    measures beyond the device's figures; each default is what the cost model assumes
    where nothing was measured, and ``None`` means "the field named in its comment".

    Time of one GEMM of ``f`` FLOPs over ``m`` rows reading ``b`` bytes (rpeg.cost.compute):
    ``max((f * (1 + matmul_m_half / m) + matmul_half) / matmul_flops, b / mem_bandwidth)
    + launch_overhead``: small GEMMs do not reach the large-GEMM rate, nor do skinny ones.
    """

    name: str
    memory: float = _q("bytes")                    # device memory capacity
    peak_flops: float = _q("flops")                # datasheet dense bf16 (reference only)
    matmul_flops: float = _q("flops")              # measured large-GEMM throughput
    fp8_flops: float = _q("flops", 0.0)            # large FP8 GEMM throughput; 0: no FP8
    matmul_half: float = _q("", 1e9)               # GEMM FLOPs at which half of matmul_flops is reached
    matmul_m_half: float = _q("", 0.0)             # GEMM rows at which skinny GEMMs run at half rate
    attn_flops: float = _q("flops", 0.0)           # fused-attention throughput; 0: 0.6 x matmul_flops
    hbm_bandwidth: float = _q("bytes/s")           # datasheet memory bandwidth
    mem_bandwidth: float = _q("bytes/s")           # measured streaming bandwidth
    elem_bandwidth: float = _q("bytes/s", 0.0)     # effective rate of elementwise ops; 0: mem_bandwidth
    launch_overhead: float = _q("s", 5e-6)         # fixed cost per kernel / op call
    # Framework overheads (host-side time the device cannot hide at small sizes).
    layer_overhead: float = _q("s", 60e-6)         # per transformer layer per forward call
    call_overhead: float = _q("s", 1e-3)           # per model call (embedding, head, wrapper)
    decode_overhead: float = _q("s", 2e-3)         # per decode step (sampling, cache bookkeeping)
    backward_factor: float = _q("", 2.0)           # backward time / forward time
    optimizer_tensor_overhead: float = _q("s", 20e-6)  # per parameter tensor per optimizer step
    sample_overhead: float = _q("s", 20e-6)        # per sample of a host-side op (python reward, gae)
    async_launch: float = _q("", 1.0)              # 1: host overhead overlaps device work (GPU); 0: adds (CPU)
    compute_bytes: float = _q("", 0.0)             # bytes per value the device computes in; 0: model dtype
    act_factor: float = _q("", 1.0)                # multiplier on the activation-memory formula
    runtime_memory: float = _q("bytes", 0.0)       # fixed transient per op (workspaces, allocator slack)
    reserve: float = _q("fraction", 0.1)           # share of memory plans leave free (fragmentation,
                                                   # spikes: vLLM's gpu_memory_utilization 0.9)
    source: str = ""                               # where the figures come from
    # Host side: the run's scheduler and control plane, and the python ops.
    dispatch_s: float = _m("s")                    # scheduler time one task crossing adds (Dask)
    host_cores: float = _m("")                     # cores the control plane shares; 0: not priced
    control_step_s: float = _m("s")                # control-plane CPU per device per step
    control_task_s: float = _m("s")                # control-plane CPU per task per step
    control_idle: float = _m("")                   # idle cluster's CPU s per s, per process
    # ... and on a host of its own (GPU clusters): one client, one Dask scheduler
    # (rpeg.cost.control; rpeg calibrate: measure_scheduler, the core on a simulated clock)
    control_call_s: float = _m("s")                # client: scheduling core + fusion per op call
    client_task_s: float = _m("s")                 # client: Dask's CPU per task
    client_arg_s: float = _m("s")                  # client: per future a task takes
    client_worker_s: float = _m("s")               # client: per worker per step (trace drain)
    scheduler_task_s: float = _m("s")              # scheduler: CPU per task
    scheduler_arg_s: float = _m("s")               # scheduler: per future a task takes
    scheduler_worker_s: float = _m("s")            # scheduler: per worker per step
    scheduler_heartbeat_s: float = _m("s")         # scheduler: per worker heartbeat
    concurrency_slowdown: float = _m("", 1.0)      # one device's op CPU time while every device of
                                                   # its host computes / alone (1 to the host's
                                                   # devices; rpeg.plan.simulate.Contention)
    reward_call_overhead: float = _m("s")          # per call of a python reward
    reward_sample_overhead: float | None = _m("s", None)  # per sample; None: sample_overhead
    reward_token_time: float = _m("s")             # per response token
    compute_call_overhead: float = _m("s")         # per call of a host compute op (gae, ...)
    compute_sample_time: float | None = _m("s", None)     # per sample; None: sample_overhead
    compute_token_time: float = _m("s", 2e-9)      # per token
    sample_logit_time: float = _m("s")             # per logit a decode step samples from (a
                                                   # row x the vocabulary: temperature, top-p,
                                                   # the draw) on the host; 0: in the step
    host_bandwidth: float = _m("bytes/s", 25e9)    # device <-> host memory, one way (offload)
    host_memory_bandwidth: float = _m("bytes/s", 12.5e9)  # one rank's CPU Adam step (passes.cpu_adam_step)
    disk_bandwidth: float = _m("bytes/s", 1e9)     # one node's checkpoint write, fsync'd
                                                   # (rpeg.cost.checkpoint; calibrated locally,
                                                   # a conservative default: spec.keys)
    hash_bandwidth: float = _m("bytes/s", 1e9)     # one writer's SHA-256 of the checkpoint files
                                                   # it wrote (every writer at once; calibrated
                                                   # locally, a conservative default)
    grads_freed: float = _m("")                    # 1: the backend frees gradients after each step
    packed_seq_overhead: float = _m("s")           # per sequence per layer of a packed pass: one
                                                   # attention call each (no varlen kernel)
    dp_tensor_overhead: float = _m("s")            # per parameter tensor per optimizer step of a
                                                   # data-parallel rank's host work: gradient
                                                   # hooks, bucket and collective copies (where
                                                   # the devices are a CPU's cores)
    shard_tensor_overhead: float = _m("s")         # ... more under FSDP2 (ZeRO 2-3): DTensor
                                                   # optimizer and clipping, its hooks
    shard_layer_overhead: float = _m("s")          # per layer per micro-batch under FSDP2
                                                   # (ZeRO 2-3, over ranks): its modules'
                                                   # gather, reshard and reduce-scatter calls
    tp_layer_overhead: float = _m("s")             # per layer per pass of a tensor-parallel
                                                   # (tp > 1) op: DTensor's host work on its
                                                   # split projections, the ranks' waits at
                                                   # its all-reduces (where the devices are a
                                                   # CPU's cores)
    tool_call_s: float = _m("s", 0.01)             # a sandboxed tool call that returns at once
    # Generation engines measured on this device (benchmarks/generation.py).
    vllm_layer_overhead: float | None = _m("s", None)     # None: layer_overhead
    vllm_decode_overhead: float | None = _m("s", None)    # None: decode_overhead
    vllm_work_scale: float = _m("", 1.0)           # vLLM's device work / the model's
    # What the calibration measured that the model reads elsewhere (reference only).
    threads: float = _m("", 1.0)                   # torch threads per device
    copy_bandwidth: float = _m("bytes/s")          # memory copy rate
    gloo_bandwidth: float = _m("bytes/s")          # all-reduce between two workers (the GPU link)
    gloo_latency: float = _m("s")
    bf16_matmul_flops: float = _m("flops")         # large bf16 GEMM throughput


@attrs.frozen
class Cluster:
    name: str
    path: str
    gpu: GpuProfile
    gpus_per_node: int
    nodes_per_rack: int = 1
    racks: int = 1
    links: tuple[Link, ...] = ()
    span: Span = NOWHERE
    # ops dispatched one call at a time by an RL framework's controller (the published
    # systems that have one), each call paying the control plane's fitted ``call_s``
    # (rpeg.cost.engines); rpeg's own runtime prices its control plane on its own terms
    controller: bool = False
    tool_cores: int = 0      # host cores per node tool calls run on (0: one per device)
    profile_file: str = attrs.field(default="", eq=False)   # the profile file it read, if any

    @property
    def tool_cores_per_node(self) -> int:
        return self.tool_cores or self.gpus_per_node

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes_per_rack * self.racks

    @property
    def num_nodes(self) -> int:
        return self.nodes_per_rack * self.racks

    def link(self, level: Level) -> Link:
        return next(link for link in self.links if link.level is level)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
