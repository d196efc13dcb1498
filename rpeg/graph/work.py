"""What an op computes: the part of its stage the cost model prices, read from the spec once.

    >>> w = work_of(load("pipelines/ppo_llama8b.rpeg"), "actor_step")      # doctest: +SKIP
    >>> w.kind, w.model.name, w.minibatches                                  # doctest: +SKIP
    (<OpKind.TRAIN: 'train'>, 'actor', 4)

Each op of the step graph carries one :class:`Work` per stage it implements (more than one
when trainers merge or ops fuse), built when the graph is built. The cost model prices an
op from its work, its placement and the cluster's profile, and never reads the spec: what
a stage's keywords change in its cost is named here. The backends read a stage's settings
here too (how it samples, its loss, its weight), not from its keywords; those settings
change no price and take no part in a work's equality.
"""

from __future__ import annotations

import attrs

from rpeg.spec.functions import function
from rpeg.spec.model import Model, OpKind, Pipeline, Workload
from rpeg.spec.registry import Type
from rpeg.spec.tools import conversation, trajectory_len


@attrs.frozen
class Work:
    stage: str
    kind: OpKind
    workload: Workload = attrs.field(eq=False, repr=False)
    model: Model | None = attrs.field(default=None, eq=False, repr=False)  # None: on the host
    per_token: bool = False           # compute: priced per response token too (GAE's recursion)
    minibatches: int = 1              # train: optimizer steps per epoch
    epochs: int = 1
    refill_rounds: int = 0            # generate: dynamic sampling's extra rounds at most
    filter_rate: float = 0.0          # ... and the share of groups each round filters out
    max_num_seqs: int = 0             # generate: sequences decoded at once (0: the engine's)
    kv_fraction: float = 0.0          # ... and its share of memory for the KV cache (0: free)
    # generate with tools: its conversation (rpeg.spec.tools.Conversation; its workload's
    # gen_len is then a turn's) and the tools it calls (their latency and cores)
    conversation: object = None
    tools: tuple = attrs.field(default=(), eq=False, repr=False)
    # what the backends read and the cost model does not: how a generate stage samples, a
    # train stage's loss (the spec's call; None: its model's default), a score stage's
    # weight where an estimator adds several scores
    sampling: Sampling | None = attrs.field(default=None, eq=False, repr=False)
    loss: object = attrs.field(default=None, eq=False, repr=False)
    weight: float = attrs.field(default=1.0, eq=False, repr=False)
    # compute: an estimator's keywords and the data they name (its run's settings)
    estimator: Estimator | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def on_host(self) -> bool:
        """A python function run beside the devices (a rule reward, an advantage estimator)."""
        return self.model is None


@attrs.frozen
class Estimator:
    """How an estimator (a compute stage: advantages, returns) runs, read off its stage once:
    every keyword of its function, given or its default (``Function.resolve``), and the data
    its data keywords name (a baseline's scores, read apart from the step's own)."""

    args: tuple[tuple[str, object], ...] = ()
    baselines: tuple[str, ...] = ()


@attrs.frozen
class Sampling:
    """How a generate stage samples: its keywords, resolved against the workload."""

    max_len: int                      # tokens a response (with tools: a turn) may have
    min_len: int = 0                  # tokens before end-of-sequence may be sampled
    temperature: float = 1.0          # 0: greedy
    top_p: float = 1.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the stage's logprobs are at: its sampling temperature; a greedy
        stage's (temperature 0) are the model's own, at 1."""
        return self.temperature if self.temperature > 0 else 1.0


def sampling_of(stage, workload: Workload) -> Sampling:
    """The sampling keywords of generate stage ``stage`` (max_len: the workload's gen_len
    max where it sets none)."""
    return Sampling(max_len=int(stage.arg("max_len") or workload.gen_len.max_len),
                    min_len=int(stage.arg("min_len") or 0),
                    temperature=float(stage.arg("temperature")),
                    top_p=float(stage.arg("top_p")))


@attrs.frozen
class Batching:
    """A generate stage's own batching keywords (0: the engine's default)."""

    max_num_seqs: int = 0
    kv_fraction: float = 0.0


def batching(stage) -> Batching:
    """The batching keywords ``generate(..., max_num_seqs = N, kv_fraction = F)`` set."""
    return Batching(int(stage.param("max_num_seqs", 0) or 0),
                    float(stage.param("kv_fraction", 0.0) or 0.0))


def work_of(pipeline: Pipeline, stage_name: str) -> Work:
    """The :class:`Work` of one stage of ``pipeline``. A stage downstream of a generate
    stage with tools works on whole conversations: its workload's response lengths are
    theirs, policy and observation tokens (:func:`rpeg.spec.tools.trajectory_len`)."""
    s = pipeline.stage(stage_name)
    has_model = pipeline.has_model(s.target or "")
    model = pipeline.model(s.target) if has_model and s.kind is not OpKind.COMPUTE else None
    w = pipeline.workload
    if s.kind is OpKind.GENERATE:
        b = batching(s)
        sampling = sampling_of(s, w)
        conv = conversation(s, sampling.max_len)
        used = tuple(pipeline.tool(n) for n in conv.declared) if conv is not None else ()
        return Work(stage=s.name, kind=s.kind, workload=w, model=model,
                    refill_rounds=int(s.arg("refill_rounds") or 0),
                    filter_rate=float(s.arg("filter_rate") or 0.0),
                    max_num_seqs=b.max_num_seqs, kv_fraction=b.kv_fraction,
                    conversation=conv, tools=used, sampling=sampling)
    talked = _conversation_above(pipeline, s)
    if talked is not None:
        w = attrs.evolve(w, gen_len=trajectory_len(w.gen_len, talked))
    common = dict(stage=s.name, kind=s.kind, workload=w, model=model)
    if s.kind is OpKind.TRAIN:
        return Work(**common, minibatches=int(s.param("minibatches", 1) or 1),
                    epochs=int(s.param("epochs", 1) or 1), loss=s.param("loss"))
    if s.kind is OpKind.SCORE:
        has = function(s.function).has("weight")
        return Work(**common, weight=float(s.arg("weight")) if has else 1.0)
    if s.kind is OpKind.COMPUTE:
        fn = function(s.function)
        return Work(**common, per_token=fn.pricing.per_token, estimator=Estimator(
            tuple(fn.resolve(dict(s.params)).items()),
            tuple(str(v) for k, v in s.params if fn.has(k) and fn.param(k).type is Type.DATA)))
    return Work(**common)


def _conversation_above(pipeline: Pipeline, stage, seen: frozenset = frozenset()):
    """The conversation of the first generate stage with tools whose responses ``stage``
    reads, directly or through the stages between (None: single responses)."""
    for name in stage.inputs:
        src = pipeline.producer(name)
        if src is None or src.name in seen:
            continue
        if src.kind is OpKind.GENERATE:
            conv = conversation(src, int(src.arg("max_len") or
                                         pipeline.workload.gen_len.max_len))
            if conv is not None:
                return conv
            continue
        found = _conversation_above(pipeline, src, seen | {stage.name})
        if found is not None:
            return found
    return None
