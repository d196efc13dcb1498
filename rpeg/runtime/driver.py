"""Running a plan on Dask: the adapter between the scheduling core and a cluster.

    >>> result = run(pipeline, plan, RunOptions(steps=4), spec_path="pipelines/tiny_ppo.rpeg")  # doctest: +SKIP
    >>> result.path, result.metrics[-1]["reward"]                                             # doctest: +SKIP
    (PosixPath('runs/tiny_ppo-20261130-011500'), 0.41)

Device i of the plan is the i-th worker (sorted by address) that offers the
resource ``GPU``; every op call is a future pinned to its device's worker, with
the futures of its dependencies as arguments, so data moves between workers
and never through this process. The embedded default starts a ``LocalCluster``
on 127.0.0.1 with one single-threaded worker process per device and closes it
(and every worker process) when the run ends, however it ends. When a generate
stage of the plan uses vLLM, those workers are non-daemon processes (vLLM starts
children of its own), and every engine is shut down inside its worker before
the cluster closes.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import time
import uuid
from collections import defaultdict
from pathlib import Path

import attrs

from rpeg.errors import RpegError, RuntimeFailure
from rpeg.plan.model import Plan
from rpeg.runtime import core as C
from rpeg.runtime import fusion as F
from rpeg.runtime import worker as W
from rpeg.runtime.context import RunContext, dataset_path, read_dataset
from rpeg.runtime.instances import build_calls, model_homes
from rpeg.runtime.record import dashboard_line, write_record
from rpeg.runtime.rundir import RunDir, step_metrics
from rpeg.runtime.serial import dumps, plan_to_json
from rpeg.spec.model import Engine, Pipeline


@attrs.frozen
class RunOptions:
    steps: int | None = None               # None: the workload's
    scheduler: str | None = None           # tcp://HOST:8786, or None for a local cluster
    root: str = "runs"
    run_dir: str | None = None
    progress: bool = True
    use_cuda: bool = False
    threads: int = 1                       # torch threads per worker
    fuse: bool = True                      # consecutive ops of a device as one Dask task


@attrs.frozen
class RunResult:
    path: Path
    metrics: tuple[dict, ...]
    wall_s: float
    steps: int


def run(pipeline: Pipeline, plan: Plan, options: RunOptions, spec_path: str | None = None,
        on_step=None) -> RunResult:
    """Execute ``plan`` for ``pipeline``; write and return the run directory."""
    steps = options.steps or pipeline.workload.steps
    spec_dir = str(Path(spec_path).resolve().parent) if spec_path else str(Path.cwd())
    read_dataset(dataset_path(pipeline, spec_dir))                 # fail before any cluster
    calls = build_calls(pipeline, plan, steps)
    # k + 1 steps may run at once; one more is submitted ahead, so the scheduler holds its
    # ops and starts them the moment their inputs exist (no client round trip).
    window = max((k for _, k in plan.staleness), default=0) + 2
    rd = RunDir.create(options.root, pipeline.name, options.run_dir)
    if spec_path:
        shutil.copyfile(spec_path, rd.path / "spec.rpeg")
    rd.write_text("pipeline.json", dumps(pipeline))
    rd.write_text("plan.json", plan_to_json(plan))
    meta = {"pipeline": pipeline.name, "steps": steps, "status": "running",
            "scheduler": options.scheduler or "local", "started": time.time(),
            "homes": {k: list(v) for k, v in model_homes(pipeline, plan, _g(pipeline, plan)).items()}}
    rd.write_json("run.json", meta)
    t_start = time.time()
    with _Cluster(plan.num_devices, options.scheduler, uses_vllm(plan)) as cl:
        workers = cl.device_workers(plan.num_devices)
        ctx = RunContext.create(pipeline, plan, calls, spec_dir=spec_dir, run_dir=str(rd.path),
                                dist_addr=_rendezvous(workers[0]), use_cuda=options.use_cuda)
        ctx = attrs.evolve(ctx, threads=options.threads)
        meta["workers"] = {str(d): a for d, a in workers.items()}
        setup = cl.setup(ctx, workers)
        meta["setup_s"] = max(s["setup_s"] for s in setup)
        events: list[dict] = []
        try:
            metrics = _loop(cl, calls, steps, window, workers, rd, events, options, on_step,
                            meta)
            cl.checkpoint(pipeline, plan, workers, rd, steps)
            meta["status"] = "ok"
        except BaseException:
            meta["status"] = "failed"
            raise
        finally:
            events += cl.drain()
            rd.write_trace(events, workers, t_start)
            meta["wall_s"] = time.time() - t_start
            rd.write_json("run.json", meta)
            write_record(rd.path, spec_path)
    return RunResult(rd.path, tuple(metrics), meta["wall_s"], steps)


def _g(pipeline, plan):
    from rpeg.runtime.instances import graph_for
    return graph_for(pipeline, plan)


def _loop(cl, calls, steps, window, workers, rd, events, options, on_step,
          meta: dict) -> list[dict]:
    from distributed import as_completed

    core = C.Core.create(calls, steps, window)
    consumers = F.consumers_of(calls)
    futures: dict[str, object] = {}              # op id -> the future of its task (group)
    id_of: dict[str, tuple[str, ...]] = {}
    pending_events: dict[int, list[dict]] = defaultdict(list)
    metrics: list[dict] = []
    done = as_completed()
    last = time.time()
    bar = _Progress(steps, options.progress)
    instructions = core.handle(C.Started())
    try:
        while True:
            # Submissions first: the per-step bookkeeping (a round trip to every worker)
            # must not delay work that is ready.
            instructions = sorted(instructions, key=_urgency)
            batch = [ins.call for ins in instructions if isinstance(ins, C.Submit)]
            finished = lambda d: d in futures and futures[d].status == "finished"  # noqa: E731
            for g in F.fuse(batch, consumers, finished, options.fuse,
                            task_of=lambda d: futures[d].key):
                f = F.submit(cl.client, g, futures, workers[g.device],
                             key=f"{g.ids[0]}+{len(g.ids) - 1}-{cl.token}")
                for op_id in g.ids:
                    futures[op_id] = f
                id_of[f.key] = g.ids
                done.add(f)
                meta["tasks"] = meta.get("tasks", 0) + 1
            for ins in instructions:
                if isinstance(ins, C.Submit):
                    continue
                elif isinstance(ins, C.Release):
                    futures.pop(ins.op_id, None)
                elif isinstance(ins, C.StepDone):
                    now = time.time()
                    for e in cl.drain():
                        pending_events[e["step"]].append(e)
                    step_events = pending_events.pop(ins.step, [])
                    events += step_events
                    row = step_metrics(ins.step, step_events, now - last)
                    last = now
                    rd.append_metrics(row)
                    metrics.append(row)
                    bar.update(row)
                    if on_step is not None:
                        on_step(row)
                elif isinstance(ins, C.Abort):
                    raise _failure(ins, core)
                elif isinstance(ins, C.Finish):
                    for evs in pending_events.values():
                        events += evs
                    return metrics
            f = next(done, None)
            if f is None:                   # nothing in flight, yet the core is not finished
                pending = [i for i, st in core.status.items() if st == "pending"][:5]
                raise RuntimeFailure(f"the run stalled after step {core.steps_done}: nothing "
                                     f"is running and {', '.join(pending)} cannot start",
                                     hint="this is a bug in the runtime's ordering; "
                                          "please report it with the run directory")
            ids = id_of.pop(f.key)
            if f.status == "error":
                err = f.exception()
                op_id = getattr(err, "rpeg_op", ids[0])
                instructions = core.handle(C.OpFailed(op_id, _describe(err)))
                if isinstance(err, RpegError):
                    raise err
            else:
                instructions = []
                for op_id in ids:
                    instructions += core.handle(C.OpDone(op_id))
    finally:
        bar.close()
        for f in futures.values():
            f.cancel()


def _urgency(ins) -> int:
    return 0 if isinstance(ins, (C.Submit, C.Release)) else 1


def _describe(err) -> str:
    return f"{type(err).__name__}: {err}"


def _failure(ins, core) -> RuntimeFailure:
    call = core.calls[ins.op_id]
    return RuntimeFailure(f"op '{ins.op_id}' (stage {call.op}, step {call.step}) failed on "
                          f"device {call.device}: {ins.error}",
                          hint="the trace and metrics up to the failure are in the run directory")


def uses_vllm(plan: Plan) -> bool:
    """Whether any stage of ``plan`` generates with vLLM (its workers must then be non-daemon)."""
    return any(p.engine is Engine.VLLM for p in plan.placements)


def _rendezvous(address: str) -> str:
    host = address.split("://")[-1].rsplit(":", 1)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1" if host in ("127.0.0.1", "localhost") else "", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


class _Cluster:
    """A Dask client on a local cluster we own, or on a scheduler someone else runs."""

    def __init__(self, devices: int, scheduler: str | None, vllm: bool = False) -> None:
        self.devices = devices
        self.scheduler = scheduler
        self.vllm = vllm
        self.cluster = None
        self.client = None
        self.token = uuid.uuid4().hex[:8]
        self._config = contextlib.ExitStack()

    def __enter__(self) -> _Cluster:
        from distributed import Client, LocalCluster
        if self.vllm and not self.scheduler:
            # vLLM starts child processes, which a daemon worker cannot have; the nanny reads
            # the setting at every worker (re)start, so it holds for the cluster's whole life.
            import dask

            from backends.vllm_backend.host import vllm_dask_config
            self._config.enter_context(dask.config.set(vllm_dask_config()))
        if self.scheduler:
            try:
                self.client = Client(self.scheduler, timeout=10)
            except OSError as e:
                raise RuntimeFailure(f"scheduler {self.scheduler} must be reachable, and it is "
                                     f"not ({e})", hint="start it with `dask scheduler` and "
                                     "workers with `dask worker ADDR --nthreads 1 "
                                     "--resources GPU=1`") from e
        else:
            self.cluster = LocalCluster(n_workers=self.devices, threads_per_worker=1,
                                        processes=True, resources={"GPU": 1},
                                        host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                        silence_logs=logging.CRITICAL)
            self.client = Client(self.cluster)
        if line := dashboard_line(self.client):
            print(line, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.client is not None and self.client.status == "running":
                try:
                    self.client.run(W.teardown)
                except Exception:  # noqa: BLE001 — best effort: the processes end below anyway
                    pass
        finally:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()
            self._config.close()

    def device_workers(self, n: int) -> dict[int, str]:
        info = self.client.scheduler_info(n_workers=-1)["workers"] if self.scheduler else \
            self.client.scheduler_info()["workers"]
        gpu = sorted(a for a, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1)
        if len(gpu) < n:
            raise RuntimeFailure(f"the plan needs {n} workers with resource GPU=1, and the "
                                 f"cluster has {len(gpu)}",
                                 hint="start one worker per device with --resources GPU=1")
        # One thread per device worker is what keeps two ops off one device at once, so op
        # tasks need not request the resource (resource-restricted tasks take a slower path
        # through the scheduler: about twice the dispatch gap, measured on this machine).
        for a in gpu[:n]:
            threads = info[a].get("nthreads", 1)
            if threads != 1:
                raise RuntimeFailure(f"worker {a} must run 1 thread, not {threads}",
                                     hint="start device workers with --nthreads 1")
        return dict(enumerate(gpu[:n]))

    def setup(self, ctx: RunContext, workers: dict[int, str]) -> list[dict]:
        futs = [self.client.submit(W.setup, ctx, d, workers=[a], allow_other_workers=False,
                                   key=f"setup-{d}-{self.token}", pure=False)
                for d, a in workers.items()]
        try:
            return self.client.gather(futs)
        except RpegError:
            raise
        except Exception as e:
            raise RuntimeFailure(f"worker set-up must succeed, and it failed: "
                                 f"{type(e).__name__}: {e}") from e

    def drain(self) -> list[dict]:
        if self.client is None or self.client.status != "running":
            return []
        return [e for evs in self.client.run(W.drain).values() for e in evs]

    def checkpoint(self, pipeline, plan, workers, rd: RunDir, steps: int) -> None:
        homes = model_homes(pipeline, plan, _g(pipeline, plan))
        futs = []
        for model, devices in homes.items():
            path = str(rd.path / "checkpoints" / f"{model}-step{steps}")
            futs.append(self.client.submit(W.checkpoint, model, path, {"step": steps},
                                           workers=[workers[devices[0]]], pure=False,
                                           key=f"ckpt-{model}-{self.token}"))
        self.client.gather(futs)


class _Progress:
    def __init__(self, steps: int, enabled: bool) -> None:
        self.p = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        self.p = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                          TextColumn("{task.fields[info]}"), transient=False)
        self.task = self.p.add_task("run", total=steps, info="")
        self.p.start()

    def update(self, row: dict) -> None:
        if self.p is None:
            return
        info = f"reward {row.get('reward', float('nan')):.3f}  step {row['step_time_s']:.2f}s"
        self.p.update(self.task, advance=1, info=info)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
