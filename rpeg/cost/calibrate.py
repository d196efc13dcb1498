"""Fitting a device profile to measurements (the pure half of ``rpeg calibrate``).

    >>> m = json.loads(Path("calibration.json").read_text())       # doctest: +SKIP
    >>> fit = fit_profile(m, name="local_cpu")                      # doctest: +SKIP
    >>> fit.profile.matmul_flops, fit.link.bandwidth                # doctest: +SKIP

The measurements come from ``backends.torch_backend.measure.calibration_measurements``
(GEMM sweep, copy bandwidth, the executor's host ops — the shipped python reward, GAE,
group normalisation — small-model forward, generate and train latencies timed under the
workers' allocator settings and peaks read under ``MALLOC_ENV``, gloo all-reduce between
two worker processes, train ops data-parallel over those two under each ZeRO level the
runtime executes) and from
``rpeg.runtime.calibrate.dispatch.measure_dispatch`` (the gap one Dask task adds:
``dispatch_s``). Every
fitted coefficient is read through the cost model itself: a feature is the change
in the model's prediction per unit of that coefficient, so what is fitted is exactly
what ``estimate_stage`` later uses. Fits minimise relative error (rows divided by the
measured value), with non-negative coefficients.
"""

from __future__ import annotations

import json  # noqa: F401  (doctest)
import math
import os
from pathlib import Path  # noqa: F401  (doctest)

import attrs
import numpy as np

from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.memory import resident_memory
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.kinds import Zero
from rpeg.spec.model import Cluster, Engine, GpuProfile, LengthDist, LengthKind, Level, Link
from rpeg.spec.presets import PRESETS, ModelDims

_HUGE = 1e30
# glibc settings under which freed tensors go back to the system, so peak readings are clean.
# Ops are timed without them, under glibc's defaults, as rpeg's workers run (see
# ``rpeg.runtime.dask.driver``): with them a tiny model's train step costs ~2.4x the CPU time.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
_STAGE = {"forward": "ref_lp", "generate": "rollout", "train": "actor_step"}


def worker_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) without glibc's malloc thresholds: the allocator
    settings of rpeg's workers, under which ops are timed."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in MALLOC_ENV}


def clean_env(env: dict | None = None) -> dict:
    """``env`` with ``MALLOC_ENV``: freed tensors go back to the system (peak readings)."""
    return {**(os.environ if env is None else env), **MALLOC_ENV}


def allocator(env: dict | None = None) -> str:
    """Which settings a process started with ``env`` (default: this one) runs under:
    ``worker`` (glibc defaults), ``clean`` (``MALLOC_ENV``) or ``other``."""
    env = os.environ if env is None else env
    got = {k: env.get(k) for k in MALLOC_ENV}
    if all(v is None for v in got.values()):
        return "worker"
    return "clean" if got == MALLOC_ENV else "other"


@attrs.frozen
class Fit:
    profile: GpuProfile
    link: Link
    residuals: tuple[tuple[str, float], ...]      # op -> relative latency error on its own fit
    measured: frozenset[str] = frozenset()        # the host-side profile fields it measured


def cpu_cluster(profile: GpuProfile, link: Link, devices: int = 2) -> Cluster:
    """This machine as a cluster: ``devices`` worker processes in one node."""
    return Cluster("local_cpu", "<calibrated>", profile, devices, 1, 1, (link,))


def cluster_text(name: str, profile_path: str, link: Link, devices: int = 2) -> str:
    """The ``local_cpu`` cluster file: ``devices`` worker processes, the measured link."""
    return (f"# This machine: {devices} CPU devices (one Dask worker process each), one node.\n"
            f"# Written by rpeg calibrate; the link is gloo all-reduce over 127.0.0.1.\n"
            f"cluster {name} {{\n"
            f'    gpu            = "{profile_path}"\n'
            f"    gpus_per_node  = {devices}\n"
            f"    nodes_per_rack = 1\n"
            f"    racks          = 1\n"
            f"    link gpu {{ bandwidth = {link.bandwidth / 1e6:.1f} MB/s; "
            f"latency = {link.latency * 1e6:.1f} us }}\n"
            f"}}\n")


def predict_op(kind: str, dims: ModelDims, batch: int, prompt_len: int, gen_len: int,
               cluster: Cluster, par: Layout = Layout(),
               devices: tuple[int, ...] = (0,), minibatches: int = 1,
               lengths=None) -> tuple[float, float]:
    """(seconds, peak bytes per device) the cost model predicts for one measured op;
    ``lengths``: the response lengths a generate op produced (else all ``gen_len``)."""
    p = ppo_pipeline(dims=dims, prompts=batch, prompt_len=prompt_len, gen_median=gen_len,
                     gen_max=gen_len, minibatches=minibatches)
    if lengths:
        p = attrs.evolve(p, workload=attrs.evolve(p.workload, gen_len=empirical(lengths,
                                                                                gen_len)))
    stage = _STAGE[kind]
    # a measured op is a direct call, not a Dask task: no dispatch
    cluster = attrs.evolve(cluster, gpu=with_dispatch(cluster.gpu, {"dispatch_s": 0.0}))
    work = work_of(p, stage)
    t = estimate_stage(work, par, devices, cluster).time_s
    mem = resident_memory(work.model, par, cluster, trained=kind == "train",
                          engine=Engine.TORCH).total \
        + stage_memory(work, par, cluster).total
    return t, mem


def empirical(lengths, max_len: int) -> LengthDist:
    """The length distribution of ``lengths`` (a histogram)."""
    values, counts = np.unique(np.asarray(lengths, int), return_counts=True)
    return LengthDist(LengthKind.EMPIRICAL, max_len=max_len,
                      bins=tuple((int(v), float(c)) for v, c in zip(values, counts, strict=True)))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (active set: drop the most negative and refit)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


def fit_gemm(rows: list[dict]) -> tuple[float, float, float]:
    """(matmul_flops, matmul_half, matmul_m_half) from a GEMM sweep:
    ``t = (f (1 + m_half / m) + half) / peak``, fitted in relative error."""
    f = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in rows])
    m = np.array([float(r["m"]) for r in rows])
    t = np.array([r["seconds"] for r in rows])
    a = np.stack([f, f / m, np.ones_like(f)], axis=1) / t[:, None]
    c = _nnls(a, np.ones_like(t))
    peak = 1.0 / c[0]
    return peak, c[2] * peak, c[1] * peak


def fit_link(rows: list[dict]) -> Link:
    """Alpha-beta of a two-device ring all-reduce: ``t = 2 alpha + bytes / bw``."""
    rows = [r for r in rows if r["bytes"] >= 2**16]
    b = np.array([float(r["bytes"]) for r in rows])
    t = np.array([r["seconds"] for r in rows])
    a = np.stack([np.full_like(b, 2.0), b], axis=1) / t[:, None]
    alpha, inv_bw = _nnls(a, np.ones_like(t))
    return Link(Level.GPU, float(1.0 / max(inv_bw, 1e-15)), float(alpha))


def _ops_of(m: dict, kinds: tuple[str, ...], packed: bool = False) -> list[dict]:
    """The measured ops of ``kinds``, padded (or ``packed``)."""
    return [o for o in m["ops"] if o["kind"] in kinds and bool(o.get("packed")) == packed]


def _dims(o: dict) -> ModelDims:
    return ModelDims(**o["dims"]) if "dims" in o else PRESETS[o["model"]]


def _predict(o: dict, profile: GpuProfile, link: Link) -> tuple[float, float]:
    """A measured op as the cost model prices it: on one device, data-parallel over
    ``o["dp"]`` devices at ZeRO level ``o["zero"]`` (``dp_train`` rows), or split over
    ``o["tp"]`` devices (``tp_ops`` rows)."""
    dp, tp = int(o.get("dp", 1)), int(o.get("tp", 1))
    par = Layout(dp=dp, tp=tp, zero=int(o.get("zero", 0)), packing=bool(o.get("packed")),
                   microbatches=int(o.get("microbatches", 1)))
    return predict_op(o["kind"], _dims(o), o["batch"], o["prompt_len"], o["gen_len"],
                      cpu_cluster(profile, link), par, devices=tuple(range(dp * tp)),
                      lengths=o.get("lengths"))


# Coefficients fitted through the cost model, as seconds per unit (rates are inverted).
_RATES = ("elem_bandwidth", "attn_flops")


def _with(base: GpuProfile, coef: dict[str, float]) -> GpuProfile:
    kw = {k: float(1.0 / v if v > 0 else _HUGE) if k in _RATES else float(v)
          for k, v in coef.items()}
    return attrs.evolve(base, **kw)


def _fit_through_model(ops, base: GpuProfile, link: Link, start: dict[str, float],
                       rounds: int = 4) -> dict[str, float]:
    """Non-negative coefficients minimising relative latency error over ``ops``.

    The model is linear in each coefficient except where a roofline ``max`` switches
    sides, so it is linearised around the current estimate and refitted a few rounds.
    """
    t = np.array([o["latency_s"] for o in ops])
    coef = dict(start)
    for _ in range(rounds):
        p0 = np.array([_predict(o, _with(base, coef), link)[0] for o in ops])
        cols = []
        for key, value in coef.items():
            h = max(abs(value) * 0.05, start[key] * 1e-3)
            p1 = np.array([_predict(o, _with(base, {**coef, key: value + h}), link)[0]
                           for o in ops])
            cols.append((p1 - p0) / h)
        jac = np.stack(cols, axis=1)
        c = np.array(list(coef.values()))
        new = _nnls(jac / t[:, None], (t - p0 + jac @ c) / t)
        coef = dict(zip(coef, new, strict=True))
    return coef


def fit_profile(m: dict, name: str = "local_cpu", devices: int = 2) -> Fit:
    """A profile of this machine's CPU devices from ``calibration_measurements`` output."""
    peak, half, m_half = (float(x) for x in fit_gemm(m["gemm"]))
    link = fit_link(m["allreduce"])
    memory = float(m["machine"]["memory_bytes"]) / devices
    base = GpuProfile(
        name, memory=memory, peak_flops=peak, matmul_flops=peak, matmul_half=half,
        matmul_m_half=m_half, hbm_bandwidth=m["copy_bandwidth"],
        mem_bandwidth=m.get("stream_bandwidth", m["copy_bandwidth"]), elem_bandwidth=_HUGE, attn_flops=_HUGE,
        launch_overhead=0.0, layer_overhead=0.0, call_overhead=0.0, decode_overhead=0.0,
        backward_factor=0.0, optimizer_tensor_overhead=0.0, sample_overhead=m.get("sample_s", 0.0),
        async_launch=0.0, compute_bytes=4.0, act_factor=1.0, runtime_memory=0.0,
        # the torch backend drops gradients after each step (zero_grad(set_to_none=True))
        grads_freed=1.0)
    # A decode step's sampling, measured on the engine's code path by itself: its fixed
    # part and its part per logit are then no terms the fit below may trade against the
    # layers' (fitted with them, the fixed part went to 0 and the per-logit part into the
    # per-layer term: a batch of 48 generated 11-13% slower than priced, a batch of 4 up
    # to 8% faster).
    sampling = fit_sampling(m.get("sampling", []))
    base = attrs.evolve(base, **sampling)

    # 1. Inference: elementwise rate, attention rate, per-layer / per-call / per-step /
    #    per-sample costs.
    inf_ops = _ops_of(m, ("forward", "generate"))
    start = {"elem_bandwidth": 1 / 3e9, "attn_flops": 1 / 5e9, "layer_overhead": 1e-4,
             "call_overhead": 1e-4, **({} if sampling else {"decode_overhead": 1e-4})}
    prof = _with(base, _fit_through_model(inf_ops, base, link, start))

    # 2. Training: the optimizer's per-tensor cost (measured alone), then backward / forward.
    per_tensor = [(o["seconds"] - o["params"] * 28 / prof.mem_bandwidth) / o["tensors"]
                  for o in m["optimizer"]]
    prof = attrs.evolve(prof, optimizer_tensor_overhead=max(float(np.median(per_tensor)), 0.0))
    tr_ops = _ops_of(m, ("train",))
    prof = _with(prof, _fit_through_model(tr_ops, prof, link, {"backward_factor": 2.0}))
    # Packed passes: what one attention call per sequence and layer adds (the rest is
    # priced by the terms above, on the responses' own lengths).
    packed = _ops_of(m, ("forward", "train"), packed=True)
    seq = {"packed_seq_overhead": 1e-5}
    if packed:
        prof = _with(prof, _fit_through_model(packed, prof, link, seq))

    # Data-parallel training (DDP and FSDP2 on two worker ranks, each rank's whole CPU: its
    # gloo threads' copies compete for the same cores): the host work per parameter tensor
    # per step beyond the compute and the link's collectives priced above, and what
    # FSDP2's sharded parameters add to it.
    dp_ops = m.get("dp_train", [])
    dp_terms = {"dp_tensor_overhead": 1e-5, "shard_tensor_overhead": 1e-4}
    sharded = any(Zero.of(o.get("zero", 0)).shards_grads for o in dp_ops)
    if any(o.get("microbatches", 1) > 1 for o in dp_ops
           if Zero.of(o.get("zero", 0)).shards_grads):
        # ... and FSDP2's calls per layer per micro-batch, from the ops in two
        dp_terms["shard_layer_overhead"] = 1e-4
    if dp_ops and sharded:
        prof = _with(prof, _fit_through_model(dp_ops, prof, link, dp_terms))

    # Tensor-parallel ops (tp = 2 over the two worker ranks, DTensor over gloo): the host
    # work per layer per pass beyond the compute and the all-reduces priced above, and the
    # waits at each all-reduce for the other rank's (wall times, the slower rank's).
    tp_ops = m.get("tp_ops", [])
    tp_terms = {"tp_layer_overhead": 1e-3}
    if tp_ops:
        prof = _with(prof, _fit_through_model(tp_ops, prof, link, tp_terms))

    # 3. Memory: a fixed per-op slack from inference ops, the activation factor from training.
    slack = [o["peak_bytes"] - _predict(o, prof, link)[1] for o in inf_ops]
    prof = attrs.evolve(prof, runtime_memory=max(float(np.median(slack)), 0.0))
    solved = [_solve_act_factor(o, prof, link) for o in tr_ops]
    prof = attrs.evolve(prof, act_factor=max(float(np.median(solved)), 0.05) if solved else 1.0)

    resid = tuple((f"{o['kind']}{' packed' if o.get('packed') else ''} {o['model']} "
                   f"b{o['batch']} p{o['prompt_len']} g{o['gen_len']}",
                   float(_predict(o, prof, link)[0] / o["latency_s"] - 1))
                  for o in m["ops"]) + tuple(
        (f"{o['kind']} dp{o['dp']} zero {o['zero']} {o['model']} b{o['batch']} "
         f"p{o['prompt_len']} g{o['gen_len']} mb{o.get('microbatches', 1)}",
         float(_predict(o, prof, link)[0] / o["latency_s"] - 1)) for o in m.get("dp_train", [])) \
        + tuple((f"{o['kind']} tp{o['tp']} {o['model']} b{o['batch']} p{o['prompt_len']} "
                 f"g{o['gen_len']}", float(_predict(o, prof, link)[0] / o["latency_s"] - 1))
                for o in tp_ops)
    bf16 = m.get("gemm_bf16") or []
    host = {"threads": float(m.get("threads", 1)), "grads_freed": 1.0, **sampling,
            **({"packed_seq_overhead": prof.packed_seq_overhead} if packed else {}),
            **({k: getattr(prof, k) for k in dp_terms} if dp_ops and sharded else {}),
            **({k: getattr(prof, k) for k in tp_terms} if tp_ops else {}),
            **fit_host(m.get("host", [])),
            "concurrency_slowdown": contention_in_range(m.get("concurrency", 1.0), devices),
            "copy_bandwidth": float(m["copy_bandwidth"]),
            "gloo_bandwidth": link.bandwidth, "gloo_latency": link.latency}
    if "checkpoint_io" in m:         # rpeg.runtime.calibrate.disk: measured, no fit
        host.update({k: float(m["checkpoint_io"][k])
                     for k in ("disk_bandwidth", "hash_bandwidth")})
    if "dispatch" in m:
        host["dispatch_s"] = fit_dispatch(m["dispatch"])
    if "control" in m:
        host.update(fit_control(m["control"]))
    if "scheduler" in m:
        host.update(fit_scheduler(m["scheduler"], m.get("core")))
    if bf16:
        host["bf16_matmul_flops"] = float(np.median(
            [2.0 * r["m"] * r["n"] * r["k"] / r["seconds"] for r in bf16]))
    prof = attrs.evolve(prof, **host, source=_source(m))
    if "control" in m:
        resid += control_residuals(m["control"], prof)
    return Fit(prof, link, resid, frozenset(host))


def fit_host(rows: list[dict]) -> dict[str, float]:
    """Host-op terms of the cost model from ``measure.host_ops`` rows (the executor running
    the shipped python reward and advantage functions at several batch sizes and response
    lengths, each call after a model op as in a run), each a non-negative fit in relative
    error of ``t = c + a * batch + b * tokens``: the reward's ``reward_call_overhead``,
    ``reward_sample_overhead`` and ``reward_token_time``; the advantage functions' shared
    ``compute_call_overhead`` and ``compute_sample_time``, and ``compute_token_time`` from
    the per-token one (GAE; group estimators have no token term, as in
    ``rpeg.cost.stages``).

    >>> rows = [{"function": "reward", "batch": b, "tokens": b * n,
    ...          "seconds": 2e-4 + b * 3e-6 + b * n * 1e-7} for b, n in ((16, 4), (64, 20),
    ...                                                                  (64, 4))]
    >>> {k: round(v, 9) for k, v in fit_host(rows).items()}
    {'reward_call_overhead': 0.0002, 'reward_sample_overhead': 3e-06, 'reward_token_time': 1e-07}
    """
    from rpeg.spec.functions import by_category, find
    from rpeg.spec.registry import Category
    out: dict[str, float] = {}
    groups = (("reward", ("reward",)),
              ("compute", tuple(f.name for f in by_category(Category.ESTIMATOR))))
    names = {"reward": ("reward_call_overhead", "reward_sample_overhead", "reward_token_time"),
             "compute": ("compute_call_overhead", "compute_sample_time", "compute_token_time")}
    for group, functions in groups:
        sel = [r for r in rows if r["function"] in functions]
        if not sel:
            continue
        t = np.array([r["seconds"] for r in sel])
        a = np.array([[1.0, r["batch"], r["tokens"] if _per_token(r["function"], find)
                       else 0.0] for r in sel], float) / t[:, None]
        x = _nnls(a, np.ones_like(t))
        call, sample, token = names[group]
        out[call], out[sample] = float(x[0]), float(x[1])
        if a[:, 2].any():
            out[token] = float(x[2])
    return out


def _per_token(name: str, find) -> bool:
    """A host function whose work grows with the response tokens (the reward decodes them;
    the registry's pricing says which estimators do)."""
    fn = find(name)
    return name == "reward" or (fn is not None and fn.pricing.per_token)


def fit_dispatch(d: dict) -> float:
    """Seconds one Dask task adds between its dependency's end and its own start, from
    ``rpeg.runtime.calibrate.dispatch.measure_dispatch`` output: the median gap of task chains
    alternating between two workers (``cross_worker_s``). The runtime fuses consecutive ops
    of a device into one task, so a model stage starts a task of its own when its input
    comes from the other device, and that is the gap it waits (a task after one on the
    same worker waits less: ``same_worker_s``). The simulator charges it wherever an op's
    input comes from other devices.

    >>> fit_dispatch({"dispatch_s": 0.004, "same_worker_s": 0.003, "cross_worker_s": 0.006})
    0.006
    """
    value = float(d.get("cross_worker_s", d["dispatch_s"]))
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        from rpeg.errors import CostError
        raise CostError(f"the measured dispatch gap must be between 0 and 1 s, not {value}")
    return value


def fit_sampling(rows: list[dict]) -> dict[str, float]:
    """``decode_overhead`` (seconds a step) and ``sample_logit_time`` (seconds per row x
    vocabulary entry) from ``backends.torch_backend.measure_sampling.sampling_rows``: least
    squares in relative error, both terms non-negative.

        >>> pts = [{"rows": r, "vocab": v, "seconds": 4e-5 + r * v * 2.5e-8}
        ...        for r in (1, 8, 64) for v in (259, 1024)]
        >>> {k: round(x, 12) for k, x in fit_sampling(pts).items()}
        {'decode_overhead': 4e-05, 'sample_logit_time': 2.5e-08}
    """
    if not rows:
        return {}
    t = np.array([r["seconds"] for r in rows], float)
    a = np.array([[1.0, r["rows"] * r["vocab"]] for r in rows], float) / t[:, None]
    x, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if x[0] < 0:                               # no fixed part: the slope alone
        x = np.array([0.0, float(np.sum(a[:, 1]) / np.sum(a[:, 1] ** 2))])
    if x[1] < 0:
        x = np.array([float(np.sum(a[:, 0]) / np.sum(a[:, 0] ** 2)), 0.0])
    return {"decode_overhead": float(x[0]), "sample_logit_time": float(x[1])}


def fit_control(c: dict) -> dict[str, float]:
    """The control-plane terms of :func:`rpeg.cost.control.shared_cores_cpu` from
    ``rpeg.runtime.calibrate.dispatch.measure_control``: ``control_idle``, the CPU seconds
    per second an idle cluster burns per process (measured, ``measure_idle``), then CPU
    seconds per step ``W - control_idle * (devices + 1) * wall = control_step_s * devices
    + control_task_s * tasks``, a non-negative fit in relative error over the measured runs,
    and ``host_cores``, the cores the devices share with the control plane.

    >>> runs = [{"devices": d, "tasks_per_step": n, "wall_per_step_s": w,
    ...          "control_cpu_per_step_s": 0.015 * d + 0.003 * n + 0.02 * (d + 1) * w}
    ...         for d, n, w in ((2, 7, 0.1), (2, 15, 0.12), (1, 1, 0.08))]
    >>> idle = {"cpu_per_process_s": 0.02}
    >>> t = fit_control({"runs": runs, "idle": idle, "host_cores": 2})
    >>> {k: round(v, 6) for k, v in t.items()}
    {'host_cores': 2.0, 'control_idle': 0.02, 'control_step_s': 0.015, 'control_task_s': 0.003}
    """
    runs = c.get("runs", [])
    if len(runs) < 2:
        return {}
    idle = float(c.get("idle", {}).get("cpu_per_process_s", 0.0))
    if not (math.isfinite(idle) and 0.0 <= idle < 1.0):
        from rpeg.errors import CostError
        raise CostError(f"an idle cluster's CPU per second per process must be between 0 and "
                        f"1, not {idle}")
    w = np.array([r["control_cpu_per_step_s"] - idle * (r["devices"] + 1)
                  * r.get("wall_per_step_s", 0.0) for r in runs], float)
    w = np.maximum(w, 1e-6)
    a = np.array([[r["devices"], r["tasks_per_step"]] for r in runs], float) / w[:, None]
    x = _nnls(a, np.ones_like(w))
    return {"host_cores": float(c["host_cores"]), "control_idle": idle,
            "control_step_s": float(x[0]), "control_task_s": float(x[1])}


def contention_in_range(measured: float, devices: int = 2) -> float:
    """The profile's ``concurrency_slowdown`` from a measured ratio (an op's CPU time while
    all of the host's ``devices`` compute over alone: ``TwoDevices.concurrency``, the same
    op on two worker processes at once and one at a time, in alternating rounds).

    The slowdown is physical only from 1 (an op computes no faster for sharing the host)
    to ``devices`` (at worst every device waits on one memory system that serves one at a
    time): noise below 1 reads as 1; a ratio above ``devices`` is no measurement of
    contention (another load on the machine), and a profile must not price it: CostError.

        >>> contention_in_range(0.98), contention_in_range(1.07)
        (1.0, 1.07)
        >>> contention_in_range(2.6)
        Traceback (most recent call last):
        rpeg.errors.CostError: error: the devices' contention (an op's CPU time while all 2 devices compute, over alone) must be from 1 to 2, not 2.6
    """
    s = float(measured)
    if not (math.isfinite(s) and s <= devices):
        from rpeg.errors import CostError
        raise CostError(f"the devices' contention (an op's CPU time while all {devices} "
                        f"devices compute, over alone) must be from 1 to {devices}, not "
                        f"{s:.3g}", hint="calibrate on a quieter machine")
    return round(max(s, 1.0), 4)


def control_residuals(c: dict, profile: GpuProfile) -> tuple[tuple[str, float], ...]:
    """Each measured run's control CPU a step as ``profile`` prices it
    (:func:`rpeg.cost.control.shared_cores_cpu`, at the run's devices, tasks and wall time a
    step) over the measured one, less 1.

    >>> p = GpuProfile("cpu", control_step_s=0.01, control_task_s=0.002, control_idle=0.02)
    >>> run = {"devices": 1, "chunks": 1, "tasks_per_step": 1, "wall_per_step_s": 0.1,
    ...        "control_cpu_per_step_s": 0.015}
    >>> [(n, round(r, 3)) for n, r in control_residuals({"runs": [run]}, p)]
    [('control plane, 1 device, 1 chunk', 0.067)]
    """
    from rpeg.cost.control import shared_cores_cpu
    out = []
    for r in c.get("runs", []):
        priced = shared_cores_cpu(profile, r["devices"], r["tasks_per_step"],
                                  r.get("wall_per_step_s", 0.0))
        name = (f"control plane, {r['devices']} device{'s' if r['devices'] > 1 else ''}, "
                f"{r.get('chunks', 1)} chunk{'s' if r.get('chunks', 1) > 1 else ''}")
        out.append((name, float(priced / r["control_cpu_per_step_s"] - 1)))
    return tuple(out)


def fit_scheduler(s: dict, core: dict | None = None) -> dict[str, float]:
    """The terms of ``rpeg.cost.control`` from
    ``rpeg.runtime.calibrate.dispatch.measure_scheduler`` (and, given ``core``,
    ``rpeg.runtime.calibrate.simulated.measure_core``'s client CPU per op call).

    Per row (a fleet of ``workers``), each process's CPU over what it did, less its idle
    rate over the same wall time: a heartbeat from the idle scheduler's CPU (Dask's rate,
    ``heartbeats_per_s``); per worker per step from the broadcasts; per task from tasks
    without arguments; per future from the same tasks taking ``deps`` futures each. The
    terms are the largest fleet's (where a worker gets one task per message, as at scale),
    the cost of a future the larger of one fetched from another worker (measured on the
    smallest fleet: fetches between hundreds of workers in one process stall) and one on
    the same worker.

    >>> cpu = lambda c, s, w: {"client_s": c, "scheduler_s": s, "workers_s": 0.0, "wall_s": w}
    >>> row = {"workers": 64, "tasks": 1000, "deps": 4, "idle": cpu(0.0, 0.32, 4.0),
    ...        "broadcast": dict(cpu(0.13, 0.64 + 0.08, 1.0), calls=10),
    ...        "tasks_0": cpu(0.4, 1.0 + 0.16, 2.0), "tasks_4": cpu(0.6, 1.8 + 0.32, 4.0)}
    >>> t = fit_scheduler({"rows": [row]}, {"call_s": 2e-5})
    >>> {k: round(v * 1e6, 1) for k, v in sorted(t.items())}      # microseconds
    {'client_arg_s': 50.0, 'client_task_s': 400.0, 'client_worker_s': 203.1, 'control_call_s': 20.0, 'scheduler_arg_s': 200.0, 'scheduler_heartbeat_s': 2500.0, 'scheduler_task_s': 1000.0, 'scheduler_worker_s': 1000.0}
    """
    from rpeg.cost.control import heartbeats_per_s
    rows = sorted(s.get("rows", []), key=lambda r: r["workers"])
    if not rows:
        return {}

    def terms(r: dict) -> dict[str, float]:
        n, k = r["workers"], r["deps"]
        idle = r["idle"]
        rate = {w: idle[f"{w}_s"] / idle["wall_s"] for w in ("client", "scheduler")}

        def busy(part: str, who: str) -> float:      # CPU over an idle run of as long
            x = r[part]
            return max(x[f"{who}_s"] - rate[who] * x["wall_s"], 0.0)
        out = {"scheduler_heartbeat_s": idle["scheduler_s"]
               / (heartbeats_per_s(n) * idle["wall_s"])}
        b = r["broadcast"]["calls"] * n
        for who in ("client", "scheduler"):
            out[f"{who}_worker_s"] = busy("broadcast", who) / b
            task = busy("tasks_0", who) / r["tasks"]
            out[f"{who}_task_s"] = task
            out[f"{who}_arg_s"] = max(busy(f"tasks_{k}", who) / r["tasks"] - task, 0.0) / k
            if f"tasks_{k}_cross" in r:
                out[f"{who}_arg_cross_s"] = max(
                    busy(f"tasks_{k}_cross", who) / r["tasks"] - task, 0.0) / k
        return out

    last, first = terms(rows[-1]), terms(rows[0])
    for who in ("client", "scheduler"):
        last[f"{who}_arg_s"] = max(last[f"{who}_arg_s"], first.get(f"{who}_arg_cross_s", 0.0))
        last.pop(f"{who}_arg_cross_s", None)
    if core:
        last["control_call_s"] = float(core["call_s"])
    return {k: float(v) for k, v in last.items()}


def with_dispatch(profile: GpuProfile, d: dict, control: dict | None = None,
                  scheduler: dict | None = None, core: dict | None = None) -> GpuProfile:
    """``profile`` with its ``dispatch_s`` from a new dispatch measurement (and, given
    ``control``, the control-plane terms of :func:`fit_control`; given ``scheduler``, those
    of :func:`fit_scheduler`), the rest kept.

    >>> p = with_dispatch(GpuProfile("cpu", threads=2.0), {"dispatch_s": 0.003})
    >>> p.dispatch_s, p.threads
    (0.003, 2.0)
    """
    return attrs.evolve(profile, dispatch_s=fit_dispatch(d),
                        **(fit_control(control) if control else {}),
                        **(fit_scheduler(scheduler, core) if scheduler else {}))


def keep_unmeasured(fit: Fit, old: GpuProfile) -> GpuProfile:
    """``fit``'s profile with the host-side fields of ``old`` the fit did not measure (e.g.
    the vLLM overheads ``benchmarks/generation.py`` measured), so recalibrating keeps them.

    >>> link = Link(Level.GPU, 1e9, 1e-5)
    >>> new = Fit(GpuProfile("cpu", threads=1.0), link, (), frozenset({"threads"}))
    >>> p = keep_unmeasured(new, GpuProfile("cpu", threads=2.0, vllm_work_scale=0.5))
    >>> p.threads, p.vllm_work_scale
    (1.0, 0.5)
    """
    kept = {f.name: getattr(old, f.name) for f in attrs.fields(GpuProfile)
            if f.metadata.get("measured") and f.name not in fit.measured}
    return attrs.evolve(fit.profile, **kept)


def _solve_act_factor(o: dict, prof: GpuProfile, link: Link) -> float:
    """The activation factor at which the predicted peak of ``o`` equals the measured one
    (the prediction rises with it, piecewise linearly: bisection)."""
    lo, hi = 0.0, 8.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _predict(o, attrs.evolve(prof, act_factor=mid), link)[1] < o["peak_bytes"]:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _source(m: dict) -> str:
    mi = m["machine"]
    return (f"rpeg calibrate on {mi.get('cpu') or 'this CPU'} ({mi.get('cores')} cores, "
            f"load {mi.get('loadavg', [0])[0]:.2f}), torch {m.get('torch')}, "
            f"{m.get('threads', 1)} thread per device, CPU-time medians under the workers' "
            f"allocator (glibc defaults)"
            f"{', model ops in a Dask worker' if m.get('ops_in') == 'worker' else ''}, "
            f"peaks under MALLOC_ENV; fitted on the "
            f"tiny, tiny4, tiny-vllm and wide2 shapes only "
            f"(held-out shapes: benchmarks/cost_accuracy.py)")


def mape(pairs) -> float:
    """Mean absolute percentage error of (predicted, measured) pairs, in percent."""
    pairs = [(p, m) for p, m in pairs if m > 0 and math.isfinite(p)]
    return 100.0 * float(np.mean([abs(p - m) / m for p, m in pairs])) if pairs else math.nan
