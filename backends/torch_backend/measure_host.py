"""Host ops as a worker runs them: the shipped python reward and advantage functions, and
a model op's per-response host work.

    >>> rows = host_ops(repeats=3)                                  # doctest: +SKIP
    >>> {r["function"] for r in rows} >= {"reward", "gae"}          # doctest: +SKIP
    True
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from backends.torch_backend.measure_env import ROOT, _median_time
from backends.torch_backend.measure_model import _arrays, op_runner
from rpeg.spec.presets import PRESETS

# Host ops as the shipped pipelines run them: their python reward and advantage estimators.
HOST_STAGES = (("tiny_ppo.rpeg", "scores"), ("tiny_ppo.rpeg", "adv"), ("tiny_grpo.rpeg", "adv"))
HOST_SHAPES = ((16, 4), (16, 20), (64, 4), (64, 12), (64, 20), (128, 4), (128, 20))


def _host_op(spec: str, stage: str, batch: int, length: int, seed: int = 0):
    """A zero-argument callable that runs ``stage`` of the shipped pipeline ``spec`` through
    the torch backend's executor (the code a worker runs: decoding, the python reward or
    the advantage function, array handling) on ``batch`` responses of ``length`` tokens."""
    import attrs

    from backends.api import RolloutChunk
    from backends.torch_backend.executor import Executor
    from rpeg.runtime.lowering.context import RunContext
    from rpeg.runtime.lowering.instances import build_calls
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    from rpeg.spec.model import OpKind
    path = ROOT / "pipelines" / spec
    p = load(path)
    w = p.workload
    p = attrs.evolve(p, workload=attrs.evolve(w, prompts=max(batch // w.samples, 1)))
    plan = split_plan(p, 1, staleness=0)
    call = next(c for c in build_calls(p, plan, 1) if c.op == stage)
    ex = Executor(RunContext.create(p, plan, (call,), run_dir=""), 0)
    rng = np.random.default_rng(seed)
    n = p.workload.batch

    def per_token():
        return tuple(rng.standard_normal(length).astype(np.float32) for _ in range(n))
    chunk = RolloutChunk(np.arange(n), tuple(np.full(w.prompt_len, 3, np.int64) for _ in range(n)),
                         tuple(rng.integers(3, 123, length).astype(np.int64) for _ in range(n)),
                         per_token(), np.ones(n, bool), 0)
    inputs = {}
    for name, _ in call.inputs:
        src = p.producer(name)
        if src.kind is OpKind.GENERATE:
            inputs[name] = [chunk if src.outputs.index(name) == 0 else chunk.logprobs]
        elif src.kind is OpKind.SCORE:
            inputs[name] = [rng.random(n).astype(np.float32)]
        else:
            inputs[name] = [per_token()]
    return lambda: ex.run(call, inputs)


def host_ops(repeats: int = 5) -> list[dict]:
    """Seconds (median CPU time) of each of ``HOST_STAGES`` at each of ``HOST_SHAPES``
    (batch, response length): what the cost model's host terms are fitted to.

    Each timed call follows a model op (a tiny model's train step, untimed), as a host op
    follows one in a run: called back to back with warm caches, the same call costs a half
    to a third of that (the reward on 64 responses: ~250 us warm, ~600 us after a step)."""
    rows = []
    model_op = op_runner("train", PRESETS["tiny"], 32, 8, 20)
    model_op()
    for spec, stage in HOST_STAGES:
        fn = host_function(spec, stage)
        for batch, length in HOST_SHAPES:
            run = _host_op(spec, stage, batch, length)
            run()
            times = []
            for _ in range(max(repeats, 3) * 3):
                model_op()
                c0 = time.thread_time()
                run()
                times.append(time.thread_time() - c0)
            rows.append({"function": fn, "pipeline": spec, "stage": stage, "batch": batch,
                         "tokens": batch * length, "seconds": statistics.median(times)})
    return rows


def host_function(spec: str, stage: str) -> str:
    """What a host stage runs, as the cost model's fit names it: "reward" for a python
    reward, else the estimator's registry name."""
    from rpeg.spec import load
    from rpeg.spec.model import OpKind
    s = load(ROOT / "pipelines" / spec).stage(stage)
    return "reward" if s.kind is OpKind.SCORE else s.function


def model_host_per_sample(samples: int = 64, prompt_len: int = 8, gen_len: int = 20,
                          repeats: int = 20) -> float:
    """Seconds per response of a model op's host work: packing prompts and responses into
    padded tensors and cutting per-response arrays back out (``Packed.build``, ``_unpad``),
    the profile's ``sample_overhead``."""
    from backends.torch_backend.train import Packed, _unpad
    prompts, responses = _arrays(samples, prompt_len, gen_len)
    out = torch.zeros(samples, gen_len)
    lengths = [gen_len] * samples

    def run():
        Packed.build(prompts, responses)
        _unpad(out, lengths)
    return _median_time(run, repeats) / samples



__all__ = ["HOST_SHAPES", "HOST_STAGES", "host_function", "host_ops", "model_host_per_sample"]
