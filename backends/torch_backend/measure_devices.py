"""Two devices: Dask worker processes on 127.0.0.1 joined by gloo, as the local cluster's.

    >>> with TwoDevices() as two:                                   # doctest: +SKIP
    ...     two.allreduce([2**20])
    [{'bytes': 1048576, 'seconds': ...}]

What is measured on them: gloo all-reduce, how much slower a device computes while the
other computes too, data-parallel train ops, and model ops in a worker's task thread (the
environment a run's ops execute in).
"""

from __future__ import annotations

import socket
import statistics
import time

import torch

from backends.torch_backend.measure_env import _median_time, set_threads, spawning
from backends.torch_backend.measure_model import measure_ops, measure_peaks, op_runner, warm_up
from rpeg.cost.calibrate import allocator
from rpeg.spec.presets import PRESETS, ModelDims


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
        from backends.torch_backend.distributed import shutdown_world
        shutdown_world()            # its groups too: the next task's world makes its own


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
    probe = _Concurrency(rank, (CONCURRENCY_OP,))      # between rounds: one op is enough
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
# The ops the tiny pipelines' runs overlap on two devices (a generation beside a train op),
# at their sizes: the contention is the CPU-weighted ratio over all of them.
CONCURRENCY_OPS = (CONCURRENCY_OP,
                   dict(kind="generate", dims=PRESETS["tiny"], batch=32, prompt_len=8,
                        gen_len=20),
                   dict(kind="train", dims=PRESETS["tiny"], batch=32, prompt_len=8,
                        gen_len=20))


class _Concurrency:
    """CPU time of each of ``ops`` on this rank while the other idles, and while both
    ranks run it at once; ``result``: the sums of the medians over the ops."""

    def __init__(self, rank: int, ops=CONCURRENCY_OPS) -> None:
        self.rank = rank
        self.runs = [op_runner(**op) for op in ops]
        for run in self.runs:
            run()
        self.alone: list[list[float]] = [[] for _ in self.runs]
        self.both: list[list[float]] = [[] for _ in self.runs]

    def round(self) -> None:
        import torch.distributed as dist
        for i, run in enumerate(self.runs):
            for active in (0, 1):
                dist.barrier()
                if self.rank == active:
                    c0 = time.process_time()
                    run()
                    self.alone[i].append(time.process_time() - c0)
                dist.barrier()
            dist.barrier()
            c0 = time.process_time()
            run()
            self.both[i].append(time.process_time() - c0)

    def result(self) -> dict:
        return {"alone": sum(statistics.median(t) for t in self.alone),
                "both": sum(statistics.median(t) for t in self.both),
                "per_op": [{"alone": statistics.median(a), "both": statistics.median(b)}
                        for a, b in zip(self.alone, self.both, strict=True)]}


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
        """How much slower a device computes while the other computes too (CPU time ratio
        over ``CONCURRENCY_OPS``, weighted by their CPU: the two share the last-level cache
        and memory bandwidth)."""
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


__all__ = ["CONCURRENCY_OP", "CONCURRENCY_OPS", "TwoDevices"]
