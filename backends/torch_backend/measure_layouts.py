"""Train ops under each training layout, measured on data-parallel ranks (benchmarks).

    >>> op = dict(dims=attrs.asdict(PRESETS["small"]), batch=16, prompt_len=32,
    ...           lengths=[8, 40, 64] * 5 + [20], zero=3, recompute=True, offload=False,
    ...           packed=True, microbatches=2)                     # doctest: +SKIP
    >>> TwoDevices(clean=True).run({"ops": [op], "peaks": True}, run_layouts)  # doctest: +SKIP

Each op is the runtime's own train path: ``build_model``, ``sharding.Trained.build`` with
the layout (DDP, FSDP2 ZeRO-2 / ZeRO-3, recomputation, offload), then per call
``before_step``, ``train_step`` over the whole batch (this rank trains its token-balanced
share, padded or packed, in ``microbatches`` passes) and ``after_step`` — what a train op
of ``rpeg run`` does on each of its devices. Peaks and times are read as
``backends.torch_backend.measure_model`` reads them: peaks under the clean allocator over the
build and two calls, times as the median CPU time of a call, round-robin over the ops.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.torch_backend.measure_env import PeakMemory, _trim
from backends.torch_backend.measure_model import measure_ops, op_runner, warm_up
from backends.torch_backend.modeling import build_model
from backends.torch_backend.sharding import Trained, TrainLayout
from backends.torch_backend.train import LossSpec, TokenHeads, TrainBatch, train_step
from rpeg.spec.functions import default_optimizer, loss_for
from rpeg.spec.model import Head, Model, Optimizer
from rpeg.spec.presets import PRESETS, ModelDims  # noqa: F401  (doctest)


def batch_of(op: dict) -> TrainBatch:
    """The op's batch, the same on every rank: prompts of ``prompt_len`` tokens, responses
    of the given ``lengths``, behaviour log-probabilities and advantages."""
    rng = np.random.default_rng(0)
    prompts = tuple(rng.integers(3, 250, op["prompt_len"]) for _ in op["lengths"])
    responses = tuple(rng.integers(3, 250, n) for n in op["lengths"])
    return TrainBatch(prompts, responses,
                      old_logprobs=tuple(np.full(n, -5.5, np.float32) for n in op["lengths"]),
                      advantages=tuple(rng.standard_normal(n).astype(np.float32)
                                       for n in op["lengths"]))


def runner(op: dict, rank: int, world: tuple[int, ...]):
    """A zero-argument callable: one train op of ``op``'s layout on this rank."""
    dims = ModelDims(**op["dims"]) if isinstance(op["dims"], dict) else op["dims"]
    members = [Model("actor", "bench", dims,
                     optimizer=Optimizer(default_optimizer().name, lr=1e-5))]
    model = build_model(dims, heads=("lm",), seed=0)
    layout = TrainLayout.of(world, tp=world if op.get("tp", 1) > 1 else (), zero=op["zero"],
                         recompute=op["recompute"],
                         offload=op["offload"])
    trained = Trained.build(model, TokenHeads(model), members, layout, device="cpu",
                            dtype=torch.float32, master=True, device_index=rank)
    batch = batch_of(op)
    losses = [LossSpec(loss_for(Head.LM).name, clip=0.2)]     # the policy's default loss
    # its data-parallel rank and degree, as a run's train call has them
    # (``OpLayout.calls``: the index of its tensor-parallel block): the ranks of a block
    # train the same share, split between them
    share, shares = world.index(rank) // layout.tp_size, layout.dp

    def run():
        trained.before_step()
        train_step(trained.heads, trained.optimizer, batch, losses, version=0,
                   microbatches=op["microbatches"], rank=share, world=shares,
                   packed=op["packed"])
        trained.after_step()
    return run


def run_layouts(rank: int, world: int, task: dict) -> dict:
    """Inside a rank of a gloo world of ``world``: the task's ops, peaks or times."""
    import torch.distributed as dist

    from backends.torch_backend.distributed import make_groups
    devices = tuple(range(world))
    make_groups([devices])
    warm_up()
    if task.get("peaks"):
        peaks = []
        for op in task["ops"]:
            dist.barrier()
            with PeakMemory() as mem:
                run = runner(op, rank, devices)
                run()
                run()
            del run
            _trim()
            peaks.append(mem.peak)
        return {"peaks": peaks}
    specs = [dict(op=op) for op in task["ops"]]
    rows = measure_ops(specs, task.get("repeats", 3), barrier=dist.barrier, memory=False,
                       build=lambda spec: runner(spec["op"], rank, devices))
    return {"ops": rows}


def dp_train_rows(two, ops, repeats: int = 3) -> list[dict]:
    """Train ops data-parallel over ``two``'s ranks (a ``measure_devices.TwoDevices``), as
    calibration rows: ``ops`` are (model name, dims, ZeRO level, batch, prompt_len,
    gen_len[, micro-batches a rank, 1 if not given]), every response ``gen_len`` tokens,
    one optimizer step per call. ``latency_s`` is the slower rank's median CPU time of its
    whole process per call: its compute, its gloo threads' copies (on a CPU they take the
    same cores) and FSDP2's host work."""
    import attrs
    ops = [tuple(o) + (1,) * (7 - len(o)) for o in ops]
    task = [dict(dims=attrs.asdict(dims), batch=b, prompt_len=p, lengths=[g] * b, zero=zero,
                 recompute=False, offload=False, packed=False, microbatches=mb)
            for _, dims, zero, b, p, g, mb in ops]
    res = two.run({"ops": task, "repeats": repeats}, run_layouts)
    world = len(res)
    return [{"kind": "train", "model": name, "dims": attrs.asdict(dims), "batch": b,
             "prompt_len": p, "gen_len": g, "dp": world, "zero": zero,
             **({"microbatches": mb} if mb > 1 else {}),
             "latency_s": max(r["ops"][i]["latency_s"] for r in res),
             "wall_s": max(r["ops"][i]["wall_s"] for r in res)}
            for i, (name, dims, zero, b, p, g, mb) in enumerate(ops)]


def run_tp(rank: int, world: int, task: dict) -> dict:
    """Inside a rank of a gloo world of ``world``: the task's ops with the model split over
    every rank (forward and generate: ``op_runner``'s reader; train: ``runner``'s
    ``sharding.Trained``), timed round-robin as ``measure_ops`` times them."""
    import torch.distributed as dist

    from backends.torch_backend.distributed import make_groups
    devices = tuple(range(world))
    make_groups([devices])
    warm_up()

    def build(spec: dict):
        if spec["kind"] == "train":
            return runner(dict(spec, lengths=[spec["gen_len"]] * spec["batch"], zero=0,
                               recompute=False, offload=False, packed=False, microbatches=1,
                               tp=world), rank, devices)
        return op_runner(spec["kind"], ModelDims(**spec["dims"]), spec["batch"],
                         spec["prompt_len"], spec["gen_len"], tp=devices)
    return {"ops": measure_ops(task["ops"], task.get("repeats", 3), barrier=dist.barrier,
                               memory=False, build=build)}


def tp_rows(two, ops, repeats: int = 3) -> list[dict]:
    """Ops split tensor-parallel over ``two``'s ranks, as calibration rows: ``ops`` are
    (kind, model name, dims, batch, prompt_len, gen_len). The ranks meet at every split
    block's all-reduce, so each waits for the other's host work: ``latency_s`` is the
    slower rank's median wall time per call (on a quiet machine; its CPU time leaves the
    waits out), ``cpu_s`` its CPU time."""
    import attrs
    task = [dict(kind=k, dims=attrs.asdict(dims), batch=b, prompt_len=p, gen_len=g)
            for k, _, dims, b, p, g in ops]
    res = two.run({"ops": task, "repeats": repeats}, run_tp)
    world = len(res)
    return [{"kind": k, "model": name, "dims": attrs.asdict(dims), "batch": b,
             "prompt_len": p, "gen_len": g, "tp": world,
             "latency_s": max(r["ops"][i]["wall_s"] for r in res),
             "cpu_s": max(r["ops"][i]["latency_s"] for r in res),
             **({"lengths": res[0]["ops"][i]["lengths"]} if k == "generate" else {})}
            for i, (k, name, dims, b, p, g) in enumerate(ops)]


__all__ = ["batch_of", "dp_train_rows", "run_layouts", "run_tp", "runner", "tp_rows"]
