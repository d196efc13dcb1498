"""Small pipelines built in Python, for doctests, tests and benchmarks.

    >>> p = ppo_pipeline("tiny", prompts=8)
    >>> [s.name for s in p.stages][:3], p.workload.batch
    (['rollout', 'ref_lp', 'values'], 8)
    >>> t = single_gpu_op("forward", "qwen2.5-0.5b", batch=8, prompt_len=256, gen_len=256)
    >>> 0 < t < 1
    True

The PPO pipeline of DESIGN.md (actor, critic with a value head, frozen reference,
python reward), with any preset and workload size. :func:`single_gpu_op` prices one op
of one model on one GPU (forward, train, torch generate) with a shipped profile (the H200
by default), for comparing against ops timed on that GPU.
"""

from __future__ import annotations

from rpeg.graph.work import work_of
from rpeg.spec.model import (
    Head,
    LengthDist,
    LengthKind,
    Model,
    OpKind,
    Optimizer,
    Pipeline,
    Reward,
    Stage,
    Workload,
    lognormal_sigma,
)
from rpeg.spec.presets import PRESETS, ModelDims


def ppo_pipeline(preset: str = "tiny", *, prompts: int = 8, samples: int = 1,
                 prompt_len: int = 64, gen_median: int = 32, gen_max: int = 64,
                 minibatches: int = 1, dims: ModelDims | None = None) -> Pipeline:
    """PPO with ``preset``'s dimensions (or ``dims``); ``gen_median >= gen_max`` fixes lengths."""
    dims = PRESETS[preset] if dims is None else dims
    gen = LengthDist(LengthKind.LOGNORMAL, max_len=gen_max, median=gen_median,
                     sigma=lognormal_sigma(gen_median, gen_max)) if gen_max > gen_median \
        else LengthDist.fixed(gen_max)
    w = Workload(steps=10, prompts=prompts, samples=samples, prompt_len=prompt_len, gen_len=gen)
    adam = Optimizer("adam", lr=1e-6)
    models = (Model("actor", preset, dims, optimizer=adam),
              Model("critic", preset, dims, head=Head.VALUE, optimizer=adam),
              Model("ref", preset, dims, frozen=True))
    st = (
        Stage("rollout", OpKind.GENERATE, "generate", "actor", ("prompts",),
              ("responses", "logprobs")),
        Stage("ref_lp", OpKind.FORWARD, "forward", "ref", ("responses",), ("ref_logprobs",)),
        Stage("values", OpKind.FORWARD, "forward", "critic", ("responses",), ("values",)),
        Stage("scores", OpKind.SCORE, "score", "verifier", ("responses",), ("scores",)),
        Stage("adv", OpKind.COMPUTE, "gae", None,
              ("scores", "values", "logprobs", "ref_logprobs"), ("advantages", "returns"),
              (("kl", 0.01),)),
        Stage("actor_step", OpKind.TRAIN, "train", "actor", ("responses", "advantages"), (),
              (("minibatches", minibatches),)),
        Stage("critic_step", OpKind.TRAIN, "train", "critic", ("responses", "returns"), ()),
    )
    # a spec's words, written out (the registry's names, as a .rpeg file would hold them)
    return Pipeline("ppo", "<python>", w, models, (Reward("verifier", "rewards", "exact_match",
                                                          kind="python"),),
                    st, staleness=(("rollout", 1),), shares=(("actor", "critic"),))


def single_gpu_op(kind: str, preset: str | ModelDims, *, batch: int, prompt_len: int,
                  gen_len: int, profile: str = "h200", engine: str = "torch") -> float:
    """Predicted seconds of one ``kind`` op (``forward``, ``train`` or ``generate``) of a
    model with ``preset``'s dimensions (or ``ModelDims``) on one GPU of ``profile``: a
    batch of ``batch`` sequences of ``prompt_len`` prompt tokens and exactly ``gen_len``
    generated tokens, in bf16, one micro-batch, one optimizer step (Adam) for ``train``."""
    from rpeg.cost.profiles import cluster_of
    from rpeg.cost.stages import estimate_stage
    from rpeg.graph.layout import Layout
    from rpeg.spec.model import Engine

    stage = {"forward": "ref_lp", "train": "actor_step", "generate": "rollout"}.get(kind)
    if stage is None:
        raise ValueError(f"kind must be forward, train or generate, not {kind!r}")
    dims = PRESETS[preset] if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else "custom"
    p = ppo_pipeline(name, prompts=batch, prompt_len=prompt_len, gen_median=gen_len,
                     gen_max=gen_len, dims=dims)
    return estimate_stage(work_of(p, stage), Layout(), (0,), cluster_of(profile, 1),
                          engine=Engine(engine)).time_s
