"""Measurements of this machine's devices, for ``rpeg calibrate`` and the accuracy benchmark.

    $ python -m backends.torch_backend.measure calibrate > m.json

    >>> t = gemm_seconds(256, 256, 256, repeats=3)           # doctest: +SKIP
    >>> op = measure_op("forward", PRESETS["tiny"], batch=4, prompt_len=16, gen_len=16)  # doctest: +SKIP
    >>> op["latency_s"], op["peak_bytes"]                     # doctest: +SKIP

Every op is the torch backend's own code path (``build_model``, ``TorchEngine``,
``forward_arrays``, ``train_step``), so what is measured is what a run executes.
Latency is the median of repeats after two warm-up calls. Peak memory is the
process's resident-set high-water mark (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) from just before the model is built to the end of its
second call, minus the resident set before: weights, optimizer state,
activations, caches and allocator slack.

Model ops are timed where a run executes them, in a Dask worker's task thread (its thread
CPU time, as a run's trace records it; beside Dask's event loop the same op costs ~10% more
than in a bare process).
Time and memory are measured under different allocator settings, in different
processes. Ops are timed under glibc's defaults, the settings rpeg's workers run
with (``rpeg.runtime.dask.driver`` keeps Dask's 64 KiB trim threshold out of them): a
64 KiB threshold makes every tensor above it a fresh mapping, page-faulted at each
use, and a tiny model's train step costs ~2.4x the CPU time. Peaks are read in a
child process started with ``MALLOC_ENV`` (``peaks_in_child``), where glibc returns
freed tensors to the system, so each reading starts clean.
One device is one process computing with one thread (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from backends.api import SamplingParams
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import EOS_ID
from backends.torch_backend.train import LossSpec, TrainBatch, forward_arrays, train_step
from rpeg.cost.calibrate import MALLOC_ENV, allocator, clean_env, worker_env
from rpeg.spec.functions import loss_for
from rpeg.spec.model import Head
from rpeg.spec.presets import PRESETS, ModelDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROOT = Path(__file__).resolve().parents[2]


# --- allocator settings -------------------------------------------------------------

@contextlib.contextmanager
def spawning(clean: bool):
    """Processes this one starts inside the block (Dask workers included: a nanny applies
    ``distributed.nanny.pre-spawn-environ``) get the clean allocator or the workers'."""
    import dask
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    for k, v in MALLOC_ENV.items():
        if clean:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    cfg = {f"distributed.nanny.pre-spawn-environ.{k}": v if clean else None
           for k, v in MALLOC_ENV.items()}
    try:
        with dask.config.set(cfg):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)


# --- memory -------------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakMemory:
    """Resident-set growth at its highest inside the ``with`` block, in bytes."""

    def __enter__(self) -> PeakMemory:
        _trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status("VmRSS")
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        self.peak = max(_status("VmHWM") - self.base, 0)


# --- micro-benchmarks ----------------------------------------------------------------

def _median_time(fn: Callable[[], object], repeats: int, min_time: float = 0.0) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < repeats or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50 * repeats:
            break
    return statistics.median(times)


def gemm_seconds(m: int, n: int, k: int, dtype: str = "fp32", repeats: int = 5) -> float:
    a = torch.randn(m, k, dtype=DTYPES[dtype])
    b = torch.randn(k, n, dtype=DTYPES[dtype])
    out = torch.empty(m, n, dtype=DTYPES[dtype])
    return _median_time(lambda: torch.mm(a, b, out=out), repeats, min_time=0.05)


def gemm_sweep(shapes, dtype: str = "fp32", repeats: int = 5) -> list[dict]:
    return [{"m": m, "n": n, "k": k, "dtype": dtype, "seconds": gemm_seconds(m, n, k, dtype,
                                                                             repeats)}
            for m, n, k in shapes]


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / t


def _stream_probe(rows: int = 4, hidden: int = 320, ffn: int = 864, layers: int = 4):
    """Skinny GEMMs over a chain of distinct weights (~20 MB): (run, bytes streamed)."""
    import torch.nn.functional as F
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)]
    ws = [torch.randn(*s) for _ in range(layers) for s in shapes]
    xs = {k: torch.randn(rows, k) for k in (hidden, ffn)}

    def run():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    return run, sum(w.numel() * 4 for w in ws)


def _copy_probe(nbytes: int = 64 * 2**20):
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


BANDWIDTH_PROBES = {"stream": _stream_probe, "copy": _copy_probe}


def stream_bandwidth(repeats: int = 20) -> float:
    """Bytes per second at which skinny GEMMs (decode: a few rows) stream their weights:
    distinct matrices, so they come from beyond the core's cache as a model's layers do."""
    run, nbytes = _stream_probe()
    return nbytes / _median_time(run, repeats)


def probe_bytes(kind: str) -> int:
    return {"stream": lambda: _stream_probe()[1], "copy": lambda: _copy_probe()[1]}[kind]()


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


# --- model ops -----------------------------------------------------------------------

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
              data_parallel: bool = False, packed: bool = False) -> Callable[[], object]:
    """A zero-argument callable that runs one op on a freshly built model.

    With ``data_parallel`` (inside a gloo group) a train op averages gradients over the
    group before each optimizer step; ``batch`` is then this rank's share. ``packed``: a
    forward or train op on responses of varied lengths packed into one row per pass (a
    plan's ``packing``), their lengths in ``run.lengths``.
    """
    if kind in BANDWIDTH_PROBES:
        return BANDWIDTH_PROBES[kind]()[0]
    if packed and kind not in ("forward", "train"):
        raise ValueError(f"only forward and train ops run packed, not {kind!r}")
    prompts, responses = _arrays(batch, prompt_len, gen_len, seed, varied=packed)
    run = _model_op(kind, dims, prompts, responses, gen_len, minibatches, data_parallel,
                    packed)
    if packed:
        run.lengths = sorted(len(r) for r in responses)
    return run


def _model_op(kind: str, dims: ModelDims, prompts, responses, gen_len: int, minibatches: int,
              data_parallel: bool, packed: bool) -> Callable[[], object]:
    if kind == "forward":
        model = build_model(dims, heads=("lm",), seed=0).eval()
        return lambda: forward_arrays(model, prompts, responses, "logprobs", packed=packed)
    if kind == "generate":
        # Responses end as a run's do: a biased end-of-sequence logit stops each with
        # probability STOP_PER_TOKEN / gen_len per token (the engine then drops it from the
        # batch and its cache), the rest at gen_len. The same seed gives the same lengths
        # each call; ``run.lengths`` holds them, for the cost model's length distribution.
        model = build_model(dims, heads=("lm",), seed=0).eval()
        q = min(STOP_PER_TOKEN / gen_len, 0.5)
        head = torch.nn.Linear(dims.hidden, dims.vocab, bias=True)
        head.weight = model.lm_head.weight
        with torch.no_grad():
            head.bias.zero_()
            head.bias[EOS_ID] = float(np.log((dims.vocab - 1) * q / (1 - q)))
        model.lm_head = head
        engine = TorchEngine(model)
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


def optimizer_seconds(dims: ModelDims, repeats: int = 5) -> dict:
    """AdamW step plus gradient clipping on a model whose gradients are set."""
    from torch import nn
    model = build_model(dims, heads=("lm",), seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    c = _median_time(step, repeats)
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "seconds": c}


# --- two devices: gloo between Dask worker processes -------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_rank(rank: int, world: int, port: int, task: dict, work=None) -> dict:
    """Runs inside a worker: join the gloo group, run ``task`` (by ``work(rank, world,
    task)`` when given, e.g. ``measure_layouts.run_layouts``), leave."""
    import torch.distributed as dist
    set_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        if work is not None:
            return work(rank, world, task)
        if task["kind"] == "allreduce":
            for _ in range(3):
                dist.all_reduce(torch.ones(1024))
            out = []
            for nbytes in task["sizes"]:
                x = torch.ones(max(nbytes // 4, 1))
                dist.barrier()
                t = _median_time(lambda x=x: dist.all_reduce(x), task.get("repeats", 5))
                out.append({"bytes": nbytes, "seconds": t})
            return {"allreduce": out}
        if task["kind"] == "concurrency":
            return _concurrency(rank, task)
        return _dp_train(rank, world, task)
    finally:
        dist.destroy_process_group()


def _dp_train(rank: int, world: int, task: dict) -> dict:
    """Data-parallel train ops: this rank's share of each batch, gradients all-reduced.
    ``task["peaks"]``: only the peak memory of each (run on workers with ``MALLOC_ENV``)."""
    import torch.distributed as dist
    warm_up()
    specs = [dict(kind="train", dims=ModelDims(**t["dims"]), batch=t["batch"] // world,
                  prompt_len=t["prompt_len"], gen_len=t["gen_len"], seed=rank,
                  data_parallel=True) for t in task["ops"]]
    if task.get("peaks"):
        return {"peaks": measure_peaks(specs, barrier=dist.barrier)}
    probe = _Concurrency(rank)
    dist.barrier()
    ops = measure_ops(specs, task.get("repeats", 3), barrier=dist.barrier,
                      each_round=probe.round, memory=False)
    return {"ops": ops, **probe.result()}


def _ops_in_worker(specs: list[dict], repeats: int) -> list[dict]:
    set_threads(1)
    warm_up()
    return measure_ops(specs, repeats, memory=False, thread=True)


CONCURRENCY_OP = dict(kind="train", dims=PRESETS["tiny-vllm"], batch=8, prompt_len=32,
                      gen_len=32)


class _Concurrency:
    """CPU time of one op on this rank while the other idles, and while both run it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.run = rank, op_runner(**CONCURRENCY_OP)
        self.run()
        self.alone: list[float] = []
        self.both: list[float] = []

    def round(self) -> None:
        import torch.distributed as dist
        for active in (0, 1):
            dist.barrier()
            if self.rank == active:
                c0 = time.process_time()
                self.run()
                self.alone.append(time.process_time() - c0)
            dist.barrier()
        dist.barrier()
        c0 = time.process_time()
        self.run()
        self.both.append(time.process_time() - c0)

    def result(self) -> dict:
        return {"alone": statistics.median(self.alone), "both": statistics.median(self.both)}


def _concurrency(rank: int, task: dict) -> dict:
    probe = _Concurrency(rank)
    for _ in range(task.get("repeats", 5)):
        probe.round()
    return probe.result()


class TwoDevices:
    """Two Dask worker processes on 127.0.0.1 (the local cluster's two CPU devices), with
    the allocator settings of rpeg's workers (glibc defaults), or with ``clean`` those of
    peak-memory readings (``MALLOC_ENV``)."""

    def __init__(self, clean: bool = False) -> None:
        self.clean = clean

    def __enter__(self) -> TwoDevices:
        from distributed import Client, LocalCluster
        with spawning(self.clean):
            self.cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                        host="127.0.0.1", dashboard_address=None,
                                        silence_logs=40)
        self.client = Client(self.cluster)
        self.workers = sorted(self.client.scheduler_info()["workers"])
        got = set(self.client.run(allocator).values())
        if got != {"clean" if self.clean else "worker"}:
            self.__exit__()
            raise RuntimeError(f"worker allocator settings must be "
                               f"{'clean' if self.clean else 'worker'}, not {got}")
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.cluster.close()

    def run(self, task: dict, work=None) -> list[dict]:
        """Each rank's result of ``task`` (``work(rank, world, task)`` runs it, when given)."""
        port = _free_port()
        futures = [self.client.submit(_on_rank, r, 2, port, task, work, workers=[w],
                                      pure=False)
                   for r, w in enumerate(self.workers)]
        return self.client.gather(futures)

    def allreduce(self, sizes, repeats: int = 5) -> list[dict]:
        res = self.run({"kind": "allreduce", "sizes": list(sizes), "repeats": repeats})
        return [{"bytes": a["bytes"], "seconds": max(a["seconds"], b["seconds"])}
                for a, b in zip(res[0]["allreduce"], res[1]["allreduce"], strict=True)]

    def concurrency(self, repeats: int = 5) -> float:
        """How much slower a device computes while the other computes too (CPU time ratio:
        the two share the last-level cache and memory bandwidth)."""
        res = self.run({"kind": "concurrency", "repeats": repeats})
        return statistics.median([r["both"] / r["alone"] for r in res])

    @staticmethod
    def _task(ops: list[dict], **kw) -> dict:
        import attrs
        return {"kind": "train", **kw,
                "ops": [{**o, "dims": attrs.asdict(o["dims"])} for o in ops]}

    def dp_train(self, ops: list[dict], repeats: int = 3) -> list[dict]:
        """Each op: dict(dims, batch, prompt_len, gen_len) with ``batch`` the global batch.

        Between rounds, a calibration op runs on each rank alone and on both at once;
        ``last_concurrency`` is the ratio, measured in the same window as the steps.
        Latency is the slower rank's median CPU time per step (compute, and the gloo
        transfer's own CPU work, but not time spent waiting for a core on a shared
        machine); ``wall_s`` is the slower rank's median wall time. ``peak_bytes`` is
        None: read it with ``dp_peaks`` on a ``clean`` pair.
        """
        res = self.run(self._task(ops, repeats=repeats))
        self.last_concurrency = statistics.median([r["both"] / r["alone"] for r in res])
        a, b = (r["ops"] for r in res)
        return [{"latency_s": max(x["latency_s"], y["latency_s"]),
                 "wall_s": max(x["wall_s"], y["wall_s"]),
                 "times_s": [x["times_s"], y["times_s"]],
                 "faults": max(x["faults"], y["faults"]), "peak_bytes": None}
                for x, y in zip(a, b, strict=True)]

    def timed_ops(self, specs: list[dict], repeats: int = 5) -> list[dict]:
        """``measure_ops`` of ``specs`` (no memory) inside one worker, while the other idles:
        the environment a run's ops execute in (a task thread beside Dask's event loop and
        its periodic callbacks), which costs the same op ~10% more thread CPU than a bare
        process does."""
        return self.client.submit(_ops_in_worker, specs, repeats, workers=[self.workers[0]],
                                  pure=False).result()

    def dp_peaks(self, ops: list[dict]) -> list[int]:
        """Peak memory of each data-parallel train op: the larger rank's."""
        res = self.run(self._task(ops, peaks=True))
        return [max(x, y) for x, y in zip(res[0]["peaks"], res[1]["peaks"], strict=True)]


# --- the calibration set -----------------------------------------------------------------

# Shapes the profile is fitted on; the accuracy benchmark evaluates none of them.
CALIBRATION_DIMS = {
    "tiny": PRESETS["tiny"],                                       # 2 layers, hidden 64
    "tiny-vllm": PRESETS["tiny-vllm"],                             # 2 layers, hidden 128
    "tiny4": ModelDims("llama", 4, 64, 4, 2, 128, 259, max_positions=512),
    "wide2": ModelDims("llama", 2, 192, 3, 3, 512, 259, max_positions=512),
}
CALIBRATION_OPS = tuple(
    (kind, name, b, p, g)
    for name in CALIBRATION_DIMS
    for kind, b, p, g in (("forward", 4, 32, 32), ("forward", 16, 64, 32),
                          ("forward", 2, 160, 32), ("forward", 48, 8, 20),
                          ("generate", 4, 16, 16), ("generate", 16, 32, 24),
                          ("generate", 48, 8, 20), ("train", 4, 32, 32),
                          ("train", 16, 32, 16), ("train", 2, 96, 32), ("train", 48, 8, 20))
)
# Packed (a plan's ``packing``): responses of varied lengths in one row per pass, each its
# own attention call on a CPU (``backends.torch_backend.attention``): the profile's
# ``packed_seq_overhead`` is fitted to these, after the padded ops above.
PACKED_OPS = tuple(
    (kind, name, b, p, g)
    for name in ("tiny", "tiny-vllm", "wide2")
    for kind, b, p, g in (("forward", 16, 32, 32), ("forward", 48, 8, 20),
                          ("train", 16, 32, 16), ("train", 48, 8, 20))
)
GEMM_SHAPES = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
               (768, 768, 768), (1024, 1024, 1024), (256, 1024, 256), (1024, 256, 512),
               (32, 512, 512), (8, 1024, 1024), (16, 256, 256), (4, 512, 128))


def warm_up() -> None:
    """Run each op kind once, unmeasured: first calls pay one-off imports and caches."""
    for kind in ("forward", "generate", "train"):
        op_runner(kind, PRESETS["tiny"], 2, 8, 8)()
    _trim()


def micro_measurements(repeats: int = 5) -> dict:
    """GEMM sweep, bandwidths, host ops (reward, advantages), optimizer steps (no model
    ops); ``allocator`` says which settings this process runs under."""
    set_threads(1)
    out: dict = {"threads": 1, "torch": torch.__version__, "machine": machine_info(),
                 "allocator": {"timing": allocator(), "memory": "clean"}}
    out["gemm"] = gemm_sweep(GEMM_SHAPES, "fp32", repeats)
    out["gemm_bf16"] = gemm_sweep(((256, 256, 256), (512, 512, 512)), "bf16", 3)
    out["copy_bandwidth"] = copy_bandwidth()
    out["stream_bandwidth"] = stream_bandwidth()
    out["host"] = host_ops(repeats)
    out["sample_s"] = model_host_per_sample()
    out["optimizer"] = [optimizer_seconds(d) for d in CALIBRATION_DIMS.values()]
    return out


def calibration_specs() -> list[tuple[dict, dict]]:
    """(description, ``op_runner`` arguments) of every calibration op, padded then packed."""
    import attrs
    return [({"kind": k, "model": n, "dims": attrs.asdict(CALIBRATION_DIMS[n]), "batch": b,
              "prompt_len": p, "gen_len": g, **({"packed": True} if packed else {})},
             dict(kind=k, dims=CALIBRATION_DIMS[n], batch=b, prompt_len=p, gen_len=g,
                  **({"packed": True} if packed else {})))
            for ops, packed in ((CALIBRATION_OPS, False), (PACKED_OPS, True))
            for k, n, b, p, g in ops]


ALLREDUCE_SIZES = (2**16, 2**18, 2**20, 2**22, 2**24)
# Bandwidth probes, timed in a round-robin of their own: in the ops' round, their 64 MB
# copy would flush the caches before the next op (a tiny model's forward then ran 2x slower
# than it does in a run, where ops follow ops).
PROBE_SPECS = [dict(kind="stream", dims=None, batch=0, prompt_len=0, gen_len=0),
               dict(kind="copy", dims=None, batch=0, prompt_len=0, gen_len=0)]


def bandwidths(measured: list[dict]) -> dict:
    """Stream and copy bandwidth from the first two ``measure_ops`` results (PROBE_SPECS)."""
    return {"stream_bandwidth": probe_bytes("stream") / measured[0]["latency_s"],
            "copy_bandwidth": probe_bytes("copy") / measured[1]["latency_s"]}


def calibration_measurements(repeats: int = 5) -> dict:
    """Everything ``rpeg calibrate`` fits a profile to, as plain data: times in this
    process (run it under the workers' allocator settings, ``worker_env``), peaks in a
    child under ``MALLOC_ENV``."""
    t0 = time.perf_counter()
    set_threads(1)
    warm_up()
    out = micro_measurements(repeats)
    specs = calibration_specs()
    out.update(bandwidths(measure_ops(PROBE_SPECS, repeats, memory=False)))
    peaks = peaks_in_child([s for _, s in specs])
    with TwoDevices() as two:
        # model ops timed where a run executes them: in a device worker's task thread
        measured = two.timed_ops([s for _, s in specs], repeats)
        out["allreduce"] = two.allreduce(ALLREDUCE_SIZES)
        out["concurrency"] = two.concurrency()
    out["ops"] = [{**meta, **r, "peak_bytes": peak} for (meta, _), r, peak in
                  zip(specs, measured, peaks, strict=True)]
    out["ops_in"] = "worker"
    out["seconds"] = time.perf_counter() - t0
    return out


def machine_info() -> dict:
    import platform
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "loadavg": list(load)}


def main(argv: list[str]) -> int:
    """``calibrate [REPEATS]``: all measurements, as JSON (re-run under the workers'
    allocator if this process was started with other settings); ``peaks``: the peak
    memory of the op specs on stdin (JSON), as a JSON list."""
    if argv[:1] == ["peaks"]:
        set_threads(1)
        warm_up()
        json.dump(measure_peaks([spec_from_json(d) for d in json.load(sys.stdin)]), sys.stdout)
        return 0
    if argv[:1] != ["calibrate"]:
        print("usage: python -m backends.torch_backend.measure calibrate [REPEATS] | peaks",
              file=sys.stderr)
        return 2
    if allocator() != "worker":
        os.execve(sys.executable, [sys.executable, "-m", "backends.torch_backend.measure",
                                   *argv], worker_env())
    repeats = int(argv[1]) if len(argv) > 1 else 5
    json.dump(calibration_measurements(repeats), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
