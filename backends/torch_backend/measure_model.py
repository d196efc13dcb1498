"""Model ops as a run executes them, timed and their peak memory read.

    >>> op = measure_op("forward", PRESETS["tiny"], batch=4, prompt_len=16, gen_len=16)  # doctest: +SKIP
    >>> op["latency_s"], op["peak_bytes"]                     # doctest: +SKIP

Every op is the torch backend's own code path (``build_model``, ``TorchEngine``,
``forward_arrays``, ``train_step``), so what is measured is what a run executes.
Latency is the median of repeats after two warm-up calls. Peak memory is the
process's resident-set growth from just before the model is built to the end of its
second call (``measure_env.PeakMemory``): weights, optimizer state, activations, caches
and allocator slack. Peaks are read in a child process started with ``MALLOC_ENV``
(``peaks_in_child``), where glibc returns freed tensors to the system, so each reading
starts clean.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from backends.api import SamplingParams
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.measure_env import ROOT, PeakMemory, _trim
from backends.torch_backend.measure_probes import BANDWIDTH_PROBES
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import EOS_ID
from backends.torch_backend.train import LossSpec, TrainBatch, forward_arrays, train_step
from rpeg.cost.calibrate import clean_env
from rpeg.spec.functions import loss_for
from rpeg.spec.model import Head
from rpeg.spec.presets import PRESETS, ModelDims


def _arrays(batch: int, prompt_len: int, gen_len: int, seed: int = 0, varied: bool = False):
    """Prompts and responses; ``varied``: response lengths drawn from 1..gen_len (the first
    at gen_len), as a run's differ, else all ``gen_len``."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 259, prompt_len).astype(np.int64) for _ in range(batch)]
    lengths = rng.integers(1, gen_len + 1, batch) if varied else np.full(batch, gen_len)
    lengths[0] = gen_len
    responses = [rng.integers(3, 259, int(n)).astype(np.int64) for n in lengths]
    return prompts, responses


def _train_batch(prompts, responses) -> TrainBatch:
    zeros = tuple(np.zeros(len(r), np.float32) for r in responses)
    adv = tuple(np.random.default_rng(1).standard_normal(len(r)).astype(np.float32)
                for r in responses)
    return TrainBatch(tuple(prompts), tuple(responses), old_logprobs=zeros, advantages=adv)


class _AllReduceAdamW(torch.optim.AdamW):
    """AdamW whose step first averages the gradients over the gloo group, in one bucket."""

    def step(self, closure=None):
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)
        return super().step(closure)


STOP_PER_TOKEN = 2.0     # a generate op's responses end at gen_len / 2 on average (uncapped)


def op_runner(kind: str, dims: ModelDims, batch: int, prompt_len: int, gen_len: int,
              minibatches: int = 1, seed: int = 0,
              data_parallel: bool = False, packed: bool = False,
              tp: tuple[int, ...] = ()) -> Callable[[], object]:
    """A zero-argument callable that runs one op on a freshly built model.

    With ``data_parallel`` (inside a gloo group) a train op averages gradients over the
    group before each optimizer step; ``batch`` is then this rank's share. ``packed``: a
    forward or train op on responses of varied lengths packed into one row per pass (a
    plan's ``packing``), their lengths in ``run.lengths``. ``tp`` (inside a gloo group of
    these ranks): a forward or generate op on the model split over them, as a run's
    tensor-parallel reader holds it (``distributed.shard_tp``); a tensor-parallel train op
    is ``measure_layouts.runner``'s.
    """
    if kind in BANDWIDTH_PROBES:
        return BANDWIDTH_PROBES[kind]()[0]
    if packed and kind not in ("forward", "train"):
        raise ValueError(f"only forward and train ops run packed, not {kind!r}")
    if len(tp) > 1 and kind not in ("forward", "generate"):
        raise ValueError(f"a tensor-parallel {kind} op is measure_layouts.runner's")
    prompts, responses = _arrays(batch, prompt_len, gen_len, seed, varied=packed)
    run = _model_op(kind, dims, prompts, responses, gen_len, minibatches, data_parallel,
                    packed, tp)
    if packed:
        run.lengths = sorted(len(r) for r in responses)
    return run


def _stop_by_length(model, dims: ModelDims, gen_len: int) -> None:
    """Bias the head's end-of-sequence logit so that a response ends with probability
    ``STOP_PER_TOKEN / gen_len`` per token (the head's weight kept, tied or not)."""
    q = min(STOP_PER_TOKEN / gen_len, 0.5)
    head = torch.nn.Linear(dims.hidden, dims.vocab, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[EOS_ID] = float(np.log((dims.vocab - 1) * q / (1 - q)))
    model.lm_head = head


def _model_op(kind: str, dims: ModelDims, prompts, responses, gen_len: int, minibatches: int,
              data_parallel: bool, packed: bool, tp: tuple[int, ...] = ()
              ) -> Callable[[], object]:
    def built(stopping: bool = False):
        model = build_model(dims, heads=("lm",), seed=0).eval()
        if stopping:
            _stop_by_length(model, dims, gen_len)
        if len(tp) > 1:         # the head too, as a run's reader splits it
            from backends.torch_backend.distributed import shard_tp
            shard_tp(model, tp, "cpu")
        return model

    if kind == "forward":
        model = built()
        return lambda: forward_arrays(model, prompts, responses, "logprobs", packed=packed)
    if kind == "generate":
        # Responses end as a run's do: a biased end-of-sequence logit stops each with
        # probability STOP_PER_TOKEN / gen_len per token (the engine then drops it from the
        # batch and its cache), the rest at gen_len. The same seed gives the same lengths
        # each call; ``run.lengths`` holds them, for the cost model's length distribution.
        engine = TorchEngine(built(stopping=True))
        params = SamplingParams(max_new_tokens=gen_len, temperature=1.0, eos_id=EOS_ID, seed=0)

        def run():
            return list(engine.generate(prompts, params))
        run.lengths = sorted(len(r) for c in run() for r in c.response_ids)
        return run
    if kind == "train":
        model = build_model(dims, heads=("lm",), seed=0).train()
        from backends.torch_backend.train import TokenHeads
        heads = TokenHeads(model)
        opt = (_AllReduceAdamW if data_parallel else torch.optim.AdamW)(heads.parameters(),
                                                                        lr=1e-5)
        tb = _train_batch(prompts, responses)
        loss = [LossSpec(loss_for(Head.LM).name, clip=0.2)]      # the default policy loss
        return lambda: train_step(heads, opt, tb, loss, version=0, minibatches=minibatches,
                                  packed=packed)
    raise ValueError(f"op kind must be forward, generate, train, stream or copy, not {kind!r}")


def measure_ops(specs, repeats: int = 5, barrier: Callable[[], object] | None = None,
                each_round: Callable[[], object] | None = None,
                memory: bool = True, build: Callable[[dict], Callable] | None = None,
                thread: bool = False) -> list[dict]:
    """Latency (and with ``memory``, peak memory) of each op in ``specs`` (dicts of
    ``op_runner`` arguments).

    First each op is built and run twice (inside its own memory window with ``memory``:
    the peak, the second call being the steady state with optimizer state allocated).
    Then the timed calls go round-robin over all ops, ``repeats`` rounds, so a burst of
    load from other processes lands on every op alike rather than on one. ``latency_s`` is
    the median CPU time of the process per call (one compute thread: on an idle machine
    it equals wall time; on a shared one it leaves out time spent waiting for a core);
    ``wall_s`` is the median wall time; ``faults`` the median minor page faults per call.
    Without ``memory``, ``peak_bytes`` is None: read it with ``peaks_in_child``.
    ``build`` makes an op's callable from its spec (default: ``op_runner(**spec)``).
    ``thread``: the calling thread's CPU time instead of the process's (in a Dask worker,
    whose other threads' CPU the control plane's terms price), as a run's trace records it.
    """
    import resource
    clock = time.thread_time if thread else time.process_time
    runners, peaks = [], []
    for spec in specs:
        if barrier is not None:
            barrier()
        with PeakMemory() if memory else contextlib.nullcontext() as mem:
            run = build(spec) if build is not None else op_runner(**spec)
            run()
            run()
        runners.append(run)
        peaks.append(mem.peak if memory else None)
    cpu = [[] for _ in specs]
    wall = [[] for _ in specs]
    faults = [[] for _ in specs]
    for _ in range(repeats):
        if each_round is not None:
            each_round()
        for i, run in enumerate(runners):
            if barrier is not None:
                barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = clock(), time.perf_counter()
            run()
            cpu[i].append(clock() - c0)
            wall[i].append(time.perf_counter() - t0)
            faults[i].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    lengths = [getattr(run, "lengths", None) for run in runners]
    del runners
    _trim()
    return [{"latency_s": statistics.median(c), "wall_s": statistics.median(w), "times_s": c,
             "faults": statistics.median(f), "peak_bytes": p,
             **({"lengths": n} if n is not None else {})}
            for c, w, f, p, n in zip(cpu, wall, faults, peaks, lengths, strict=True)]


def measure_peaks(specs, barrier: Callable[[], object] | None = None) -> list[int]:
    """Peak memory of each op in ``specs``: built and run twice in its own window, then
    dropped. Meaningful under ``MALLOC_ENV`` (see ``peaks_in_child``)."""
    peaks = []
    for spec in specs:
        if barrier is not None:
            barrier()
        with PeakMemory() as mem:
            run = op_runner(**spec)
            run()
            run()
        del run
        _trim()
        peaks.append(mem.peak)
    return peaks


def spec_json(spec: dict) -> dict:
    import attrs
    return {k: attrs.asdict(v) if isinstance(v, ModelDims) else v for k, v in spec.items()}


def spec_from_json(d: dict) -> dict:
    return {k: ModelDims(**v) if k == "dims" and v is not None else v for k, v in d.items()}


def peaks_in_child(specs) -> list[int]:
    """Peak memory of each op in ``specs``, read in a fresh process started with
    ``MALLOC_ENV`` (this process times ops under the workers' allocator, whose retained
    free memory would blur the readings)."""
    proc = subprocess.run([sys.executable, "-m", "backends.torch_backend.measure", "peaks"],
                          input=json.dumps([spec_json(s) for s in specs]), capture_output=True,
                          text=True, env=clean_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError("peak-memory measurement failed: "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(proc.stdout)


def measure_op(kind: str, dims: ModelDims, batch: int, prompt_len: int, gen_len: int,
               minibatches: int = 1, repeats: int = 3) -> dict:
    """One op alone (see ``measure_ops``)."""
    return measure_ops([dict(kind=kind, dims=dims, batch=batch, prompt_len=prompt_len,
                             gen_len=gen_len, minibatches=minibatches)], repeats)[0]



def warm_up() -> None:
    """Run each op kind once, unmeasured: first calls pay one-off imports and caches."""
    for kind in ("forward", "generate", "train"):
        op_runner(kind, PRESETS["tiny"], 2, 8, 8)()
    _trim()



__all__ = ["STOP_PER_TOKEN", "measure_op", "measure_ops", "measure_peaks", "op_runner",
           "peaks_in_child", "spec_from_json", "spec_json", "warm_up"]
