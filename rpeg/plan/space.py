"""The space a plan is chosen from: device blocks, parallel layouts, backend limits.

    >>> from rpeg.cost.profiles import cluster_of
    >>> c = cluster_of("gh200", gpus_per_node=4, nodes=2)
    >>> [(b.start, b.size) for b in device_blocks(c) if b.size >= 4]
    [(0, 4), (4, 4), (0, 8)]
    >>> [(p.dp, p.tp, p.pp) for p in layouts(4, PRESETS["llama3.1-8b"], c, Limits())]
    [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]

Blocks are contiguous, aligned runs of devices that never cut a unit of the
cluster tree they do not fill: 1, 2, 4 ... GPUs inside a node, then whole
nodes inside a rack, then whole racks. Layouts factor a block's size into
DP x TP x PP with TP inside one node, and only degrees the model can be split
by and the backend can execute (:class:`Limits`).
"""

from __future__ import annotations

import functools

import attrs

from rpeg.cost.memory import check_parallel
from rpeg.errors import CostError, PlanError
from rpeg.graph.layout import DECODING, Layout
from rpeg.spec.model import Cluster, Engine, Model, OpKind, Pipeline, Zero, zero_levels
from rpeg.spec.presets import PRESETS, ModelDims

__all__ = ["Block", "Limits", "device_blocks", "layouts", "PRESETS"]


@attrs.frozen
class Limits:
    """What the executor planned for runs: the planner never proposes more.

    ``Limits()`` is an executor with everything the cost model prices (``rpeg compile
    --any-executor``); :meth:`runtime` is rpeg's own runtime, as its backends declare it
    (:mod:`rpeg.plan.capabilities`) — what ``rpeg compile`` plans for by default.
    """

    max_tp: int = 64
    max_pp: int = 16
    max_dp: int = 1 << 20
    engines: frozenset[Engine] = frozenset({Engine.TORCH, Engine.VLLM})
    zero: frozenset[Zero] = attrs.field(default=frozenset(Zero), converter=zero_levels)  # train ops'
    recompute: bool = True            # activation recomputation in train ops
    offload: bool = True              # optimizer state in host memory between train steps
    packing: bool = True              # forward / train ops without padding
    # engines that carry unfinished responses into later steps (partial rollouts)
    carry_engines: frozenset[Engine] = frozenset({Engine.TORCH, Engine.VLLM})
    engine_tp: tuple[tuple[Engine, int], ...] = ()   # a generate engine's tp cap (else max_tp)
    # per engine: the batching keys it runs (none listed: every key), and the KV share it
    # takes when a plan leaves kv_fraction at 0 (a GPU's share, a CPU's bytes; 0: what is free)
    engine_batching: tuple[tuple[Engine, tuple[str, ...]], ...] = ()
    engine_kv: tuple[tuple[Engine, float, int], ...] = ()
    missing: tuple[tuple[str, str], ...] = ()         # what the executor lacks, and why
    max_cp: int = 64                  # context (sequence) parallel degree
    max_ep: int = 1 << 10             # expert parallel degree
    param_offload: bool = True        # weights in host memory between passes
    inference_zero: bool = True       # forward / generate on ZeRO-3-sharded weights
    batching: bool = True             # generate: max_num_seqs, kv_fraction, cuda_graph pinned
    foreign: bool = True              # engines of other systems (hf, hybrid, deepspeed, megatron)
    any_model: bool = True            # every architecture the cost model prices; else:
    families: tuple[str, ...] = ()    #   these families,
    model_features: tuple[str, ...] = ()   # these features beyond a dense block,
    dtypes: tuple[str, ...] = ()      #   these dtypes (empty: any),
    lora: bool = True                 # LoRA adapters
    lora_max_tp: int = 64             # ... trained and read at tp at most this
    lora_zero: frozenset[Zero] = attrs.field(default=frozenset(Zero),   # ... trained at these
                                             converter=zero_levels)  # ZeRO levels
    # the eval block, on the trained replica of the model it evaluates: trained at these
    # ZeRO levels and tp at most this
    eval_zero: frozenset[Zero] = attrs.field(default=frozenset(Zero), converter=zero_levels)
    eval_max_tp: int = 64

    @classmethod
    def of(cls, caps) -> Limits:
        """The limits of an executor that declares ``caps`` (a ``Capabilities``)."""
        return cls(max_tp=caps.max_tp, max_pp=caps.max_pp, max_dp=caps.max_dp,
                   engines=frozenset(e.engine for e in caps.engines),
                   zero=caps.zero, recompute=caps.recompute, offload=caps.offload,
                   packing=caps.packing,
                   carry_engines=frozenset(e.engine for e in caps.engines if e.carry),
                   engine_tp=tuple((e.engine, e.max_tp) for e in caps.engines),
                   engine_batching=tuple((e.engine, e.batching) for e in caps.engines),
                   engine_kv=tuple((e.engine, e.kv_fraction, e.cpu_kv_bytes)
                                   for e in caps.engines if e.kv_fraction or e.cpu_kv_bytes),
                   missing=caps.missing, max_cp=caps.max_cp, max_ep=caps.max_ep,
                   param_offload=caps.param_offload, inference_zero=caps.inference_zero,
                   batching=caps.batching, foreign=False, any_model=False,
                   families=tuple(sorted(caps.families)),
                   model_features=tuple(sorted(caps.model_features)),
                   dtypes=tuple(sorted(caps.dtypes)), lora=caps.lora,
                   lora_max_tp=caps.lora_max_tp, lora_zero=caps.lora_zero,
                   eval_zero=caps.eval_zero, eval_max_tp=caps.eval_max_tp)

    @classmethod
    def runtime(cls) -> Limits:
        """rpeg's runtime, as declared: the same on every machine that plans."""
        from rpeg.plan.capabilities import runtime_capabilities
        return cls.of(runtime_capabilities())

    def kv_share(self, engine: Engine, gpu) -> float:
        """The share of a device ``engine`` takes when a plan leaves ``kv_fraction`` at 0
        (``engine_kv``: on a CPU profile its KV bytes over the device's memory); 0: what is
        free."""
        for e, share, cpu in self.engine_kv:
            if e is engine:
                return min(cpu / gpu.memory, 1.0) if not gpu.async_launch and cpu else share
        return 0.0

    def check_batching(self, engine: Engine, max_num_seqs: int, kv_fraction: float,
                       cuda_graph: bool) -> str | None:
        """Why a generate stage's batching cannot run on ``engine``, or None."""
        runs = dict(self.engine_batching)
        if engine not in runs:
            return None
        for key, value in (("max_num_seqs", max_num_seqs), ("kv_fraction", kv_fraction),
                           ("cuda_graph", cuda_graph)):
            if value and key not in runs[engine]:
                return (f"{key} is not run by the {engine.value} engine on this backend "
                        f"(it runs {', '.join(runs[engine]) or 'none of them'})")
        return None

    def engine_max_tp(self, engine: Engine) -> int:
        return min(dict(self.engine_tp).get(engine, self.max_tp), self.max_tp)

    def check_parallel(self, par: Layout) -> str | None:
        """Why this layout cannot run, or None."""
        for name, cap in (("tp", self.max_tp), ("pp", self.max_pp), ("dp", self.max_dp),
                          ("cp", self.max_cp), ("ep", self.max_ep)):
            if getattr(par, name) > cap:
                return (f"{name} must be at most {cap} on this backend, not "
                        f"{getattr(par, name)}" + self.because(name))
        if par.zero not in self.zero:
            levels = ", ".join(str(z) for z in sorted(self.zero))
            return f"zero must be one of {levels} on this backend, not {par.zero}" \
                + self.because("zero")
        if par.recompute and not self.recompute:
            return "train ops must run without recomputation on this backend" \
                + self.because("recompute")
        if par.offload and not self.offload:
            return ("train ops must keep their optimizer state on the device on this backend"
                    + self.because("offload"))
        if par.packing and not self.packing:
            return "forward and train ops must pad their batches on this backend" \
                + self.because("packing")
        if par.param_offload and not self.param_offload:
            return "weights must stay on the device on this backend" \
                + self.because("param_offload")
        if par.decoding != DECODING and not self.batching:
            return ("generation must batch as the engine decides on this backend (no "
                    "max_num_seqs, kv_fraction or cuda_graph)" + self.because("batching"))
        return None

    def check_model(self, model: Model) -> str | None:
        """Why this executor cannot run ``model``, or None."""
        if self.any_model:
            return None
        d = model.dims
        if d.family not in self.families:
            return (f"model '{model.name}' must be of a family this executor builds "
                    f"({', '.join(self.families)}), not {d.family}")
        extra = sorted(d.features() - set(self.model_features))
        if extra:
            return f"model '{model.name}' has what this executor does not build: " \
                + ", ".join(_FEATURE_WORDS.get(f, f) for f in extra)
        if self.dtypes and model.dtype not in self.dtypes:
            return (f"model '{model.name}' must be in a dtype this executor runs "
                    f"({', '.join(self.dtypes)}), not {model.dtype}")
        if model.lora is not None and not self.lora:
            return f"model '{model.name}' trains LoRA adapters, which this executor does not"
        return None

    def check_lora(self, model: Model, par: Layout) -> str | None:
        """Why this executor cannot lay out ``model``'s LoRA adapters as ``par``, or None."""
        if model.lora is None:
            return None
        if par.tp > self.lora_max_tp:
            return (f"tp must be at most {self.lora_max_tp} for model '{model.name}', whose "
                    f"LoRA adapters this executor runs unsplit, not {par.tp}")
        if par.zero not in self.lora_zero:
            levels = ", ".join(str(z) for z in sorted(self.lora_zero))
            return (f"zero must be one of {levels} for model '{model.name}', whose LoRA "
                    f"adapters this executor trains unsharded, not {par.zero}")
        return None

    def check_eval(self, pipeline, stage, par: Layout) -> str | None:
        """Why the eval block could not run beside ``stage`` laid out as ``par``, or None:
        it generates with the trained replica of the model it evaluates (the first
        generate stage's), which must be whole on its first device."""
        if pipeline.evaluation is None or stage.kind is not OpKind.TRAIN \
                or stage.target != evaluated_model(pipeline):
            return None
        if par.zero not in self.eval_zero:
            levels = ", ".join(str(z) for z in sorted(self.eval_zero))
            return (f"zero must be one of {levels} for train stage '{stage.name}' of a "
                    f"pipeline with an eval block, not {par.zero}: the eval generates with "
                    f"the trained replica of '{stage.target}', which ZeRO-{par.zero} keeps "
                    "only in shards")
        if par.tp > self.eval_max_tp:
            return (f"tp must be at most {self.eval_max_tp} for train stage '{stage.name}' "
                    f"of a pipeline with an eval block, not {par.tp}: the eval generates "
                    f"with one whole trained replica of '{stage.target}'")
        return None

    def because(self, key: str) -> str:
        """`` (why)`` when the executor declares why it lacks ``key``, else ``""``."""
        reason = dict(self.missing).get(key)
        return f" ({reason})" if reason else ""

    def check_engine(self, engine: Engine, tp: int, carry: int = 0) -> str | None:
        """Why a generate stage cannot run with ``engine`` at ``tp`` carrying ``carry``."""
        if engine is Engine.AUTO:
            return None
        if engine not in self.engines:
            return f"the {engine.value} engine is not part of this backend"
        if tp > self.engine_max_tp(engine):
            return (f"tp must be at most {self.engine_max_tp(engine)} with engine = "
                    f"{engine.value} on this backend, not {tp}")
        if carry and engine not in self.carry_engines:
            return (f"the {engine.value} engine must generate whole responses each step on "
                    f"this backend, not carry them into later steps (carry {carry})")
        return None


def evaluated_model(pipeline) -> str | None:
    """The model the eval block evaluates: the first generate stage's."""
    gen = next((s for s in pipeline.stages if s.kind is OpKind.GENERATE), None)
    return gen.target if gen is not None else None


_FEATURE_WORDS = {"head_dim": "a head size other than hidden / heads", "qk_norm": "QK-norm",
                  "plain_mlp": "a plain (non-gated) MLP",
                  "learned_positions": "learned position embeddings",
                  "moe": "a mixture of experts", "mla": "multi-head latent attention"}
VLLM_MIN_HEAD_DIM = 64      # vLLM's attention kernels need head_dim >= 64


def engine_refusal(engine: Engine, model: Model) -> str | None:
    """Why ``engine`` cannot generate with ``model`` whatever is installed, or None.

        >>> engine_refusal(Engine.VLLM, Model("actor", "tiny", PRESETS["tiny"]))
        "vLLM needs head_dim >= 64; model 'actor' (tiny) has 16"
    """
    if engine is Engine.VLLM and model.dims.head_dim < VLLM_MIN_HEAD_DIM:
        return (f"vLLM needs head_dim >= {VLLM_MIN_HEAD_DIM}; model '{model.name}' "
                f"({model.preset}) has {model.dims.head_dim}")
    if engine is Engine.VLLM and model.lora is not None:
        return (f"model '{model.name}' trains LoRA adapters, which rpeg syncs into its torch "
                "engine only (not into vLLM)")
    return None


def generate_engines(pipeline: Pipeline, stage: str, limits: Limits) -> tuple[Engine, ...]:
    """The engines a generate stage may use; PlanError when the spec asks for one it cannot.

    ``engine = auto`` leaves out engines the model does not suit (vLLM below head_dim 64);
    an explicit one is refused with the reason.
    """
    s = pipeline.stage(stage)
    model = pipeline.model(s.target)
    asked = s.param("engine", Engine.AUTO)
    if asked is Engine.AUTO:
        return tuple(e for e in (Engine.VLLM, Engine.TORCH)
                     if e in limits.engines and engine_refusal(e, model) is None)
    if asked not in (Engine.TORCH, Engine.VLLM) and limits.foreign:
        return (asked,)           # another system's engine, priced where pinned
    if (why := engine_refusal(asked, model)) is not None:
        raise PlanError(f"stage '{stage}' must use an engine its model suits, not "
                        f"'{asked.value}': {why}", s.span,
                        hint="write engine = torch (or auto), or use a model with wider heads")
    if asked not in limits.engines:
        raise PlanError(f"stage '{stage}' must use an installed engine, not '{asked.value}'",
                        s.span, hint="install vLLM (GPU machines: `pip install vllm`) or "
                                     "write engine = torch (or auto)")
    return (asked,)


@attrs.frozen(order=True)
class Block:
    start: int
    size: int

    @functools.cached_property
    def devices(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))

    def overlaps(self, other: Block) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


def block_sizes(cluster: Cluster) -> tuple[int, ...]:
    gpn, npr, racks = cluster.gpus_per_node, cluster.nodes_per_rack, cluster.racks
    sizes = {k for k in _powers(gpn) if gpn % k == 0} | {gpn}
    sizes |= {gpn * k for k in _powers(npr) if npr % k == 0} | {gpn * npr}
    sizes |= {gpn * npr * k for k in _powers(racks) if racks % k == 0} | {cluster.num_gpus}
    return tuple(sorted(sizes))


def device_blocks(cluster: Cluster, max_blocks: int = 4096) -> tuple[Block, ...]:
    """Every aligned block, smallest sizes first (capped per size on huge clusters)."""
    n = cluster.num_gpus
    out: list[Block] = []
    for size in block_sizes(cluster):
        starts = range(0, n - size + 1, size)
        if len(starts) > max_blocks:
            starts = starts[:: len(starts) // max_blocks + 1]
        out += [Block(s, size) for s in starts]
    return tuple(out)


def _powers(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def layouts(size: int, dims: ModelDims, cluster: Cluster, limits: Limits,
            batch: int | None = None) -> tuple[Layout, ...]:
    """DP x TP x PP factorisations of ``size`` this model and backend accept."""
    out = []
    for pp in _divisors(size):
        for tp in _divisors(size // pp):
            dp = size // (pp * tp)
            if tp > cluster.gpus_per_node or (batch is not None and dp > batch):
                continue
            par = Layout(dp=dp, tp=tp, pp=pp, microbatches=pp)
            if limits.check_parallel(par) is not None:
                continue
            try:
                check_parallel(dims, par)
            except CostError:
                continue
            out.append(par)
    out.sort(key=lambda p: (p.pp, p.tp))
    return tuple(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
