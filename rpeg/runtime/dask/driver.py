"""Running a plan on Dask: the run's options and result, the cluster, the progress bar.

    >>> with DaskCluster(2, scheduler=None) as cl:                  # doctest: +SKIP
    ...     cl.client.ncores()

Every run goes through the resilient runner (``rpeg.runtime.dask.runner``, whose ``run`` is
the plain run: one segment, no recovery): the scheduling
core decides what to submit, ``rpeg.runtime.core.fusion`` packs it into Dask tasks. Device i of the plan is the i-th worker (sorted by address) that offers the
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
import os
import sys
import uuid
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure
from rpeg.plan.model import Plan
from rpeg.runtime.dask import worker as W
from rpeg.runtime.dask.devices import COLLECTIVE_TIMEOUT_S
from rpeg.runtime.rundir.record import dashboard_line
from rpeg.spec.model import Engine


@attrs.frozen
class RunOptions:
    steps: int | None = None               # None: the workload's
    scheduler: str | None = None           # tcp://HOST:8786, or None for a local cluster
    root: str = "runs"
    run_dir: str | None = None
    progress: bool = True
    use_cuda: bool | None = None           # None: CUDA when every device worker has a GPU
    threads: int = 1                       # torch threads per worker
    fuse: bool = True                      # consecutive ops of a device as one Dask task
    trackers: tuple[str, ...] = ()         # --tracker: instead of the spec's log { trackers }
    overrides: tuple[str, ...] = ()        # KEY=VALUE overrides the pipeline was checked with
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S   # then a collective fails


@attrs.frozen
class Resilience:
    checkpoint_every: int = 10         # steps between cuts (the last step always ends one;
                                       # 0: none between, only at evals and the end)
    timeout_factor: float = 10.0       # an op is stuck after factor x its predicted time ...
    timeout_floor_s: float = 120.0     # ... and never before this
    max_recoveries: int = 3
    replace_wait_s: float = 60.0       # how long to wait for a replacement worker
    poll_s: float = 0.1


@attrs.frozen
class RunResult:
    path: Path
    metrics: tuple[dict, ...]
    wall_s: float
    steps: int


WORKER_BYTES = 256 << 20     # a device worker's memory once torch is imported (about 250 MB)


def local_device_limit() -> int:
    """How many device workers the embedded cluster may start here: one process each,
    about 250 MB apiece, within this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(1, total // WORKER_BYTES)


def check_local_devices(devices: int) -> None:
    """Refuse, before any worker starts, a plan for more devices than the embedded cluster
    can start worker processes for on this machine."""
    limit = local_device_limit()
    if devices > limit:
        raise RuntimeFailure(f"the plan needs {devices:,} devices, and the embedded cluster "
                             f"can start at most {limit:,} worker processes on this machine "
                             f"(one per device, about {WORKER_BYTES >> 20} MB each)",
                             hint="run it on a cluster: --scheduler tcp://HOST:8786, or plan "
                                  "for fewer devices")


def plan_is_for_gpus(plan: Plan) -> bool:
    """Whether ``plan`` was priced on a cluster of GPUs (not host cores: a CPU profile)."""
    from rpeg.cost.memory import devices_are_host
    from rpeg.errors import RpegError
    from rpeg.runtime.rundir.record import find_cluster_file
    from rpeg.spec import load_cluster
    where = find_cluster_file(plan)
    if where is None:
        return False
    try:
        return not devices_are_host(load_cluster(where).gpu)
    except RpegError:
        return False


def worker_memory_limit(total: int, devices: int, host_bytes: float) -> int:
    """The memory limit of each of the embedded cluster's ``devices`` workers on a machine of
    ``total`` bytes: its fair share, or what its device needs of host memory when more
    (``host_bytes``: a CPU device's whole predicted peak; nothing extra on a GPU, whose model
    is built on the device), with the worker's own, within the machine. Dask stops a worker
    near its limit: a limit below a model's host-side needs ends the run."""
    share = total // max(devices, 1)
    return int(min(total, max(share, host_bytes + WORKER_BYTES)))


def uses_vllm(plan: Plan) -> bool:
    """Whether any stage of ``plan`` generates with vLLM (its workers must then be non-daemon)."""
    return any(p.engine is Engine.VLLM for p in plan.placements)


def rendezvous_at(address: str, port: int) -> str:
    """Where a collective world meets: the host of the worker at ``address`` (its first
    rank's), at ``port`` (free there: ``worker.free_port`` run on it)."""
    host = address.split("://")[-1].rsplit(":", 1)[0]
    return f"tcp://{host}:{port}"


class DaskCluster:
    """A Dask client on a local cluster we own, or on a scheduler someone else runs."""

    def __init__(self, devices: int, scheduler: str | None, vllm: bool = False,
                 cuda: bool | None = None, host_bytes: float = 0.0) -> None:
        self.devices = devices
        self.scheduler = scheduler
        self.vllm = vllm
        self.cuda = cuda                   # the embedded workers' GPUs: None = if enough
        self.host_bytes = host_bytes       # host memory a device worker needs
        self.cluster = None
        self.client = None
        self.token = uuid.uuid4().hex[:8]
        self._config = contextlib.ExitStack()

    def __enter__(self) -> DaskCluster:
        from distributed import Client, LocalCluster
        if self.vllm and not self.scheduler:
            # vLLM starts child processes, which a daemon worker cannot have; the nanny reads
            # the setting at every worker (re)start, so it holds for the cluster's whole life.
            import dask

            import backends
            self._config.enter_context(dask.config.set(backends.load("vllm", "dask_config")()))
        if self.scheduler:
            self.client = _connect(self.scheduler)
        else:
            import dask

            # Dask starts worker processes with glibc's trim threshold at 64 KiB, which also
            # fixes the mmap threshold: every tensor above 128 KiB is then a fresh mapping,
            # page-faulted in and unmapped again at each use (a tiny model's train step ran
            # 2.3x slower, ~23k faults each). rpeg's workers keep their memory.
            # A nanny started earlier in this process (a cluster of Dask's defaults) leaves
            # its value in os.environ, which every later worker would inherit.
            self._config.enter_context(dask.config.set(
                {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}))
            if os.environ.get("MALLOC_TRIM_THRESHOLD_") == "65536":
                del os.environ["MALLOC_TRIM_THRESHOLD_"]
            self.cluster = self._local_cluster(LocalCluster)
            self.client = Client(self.cluster)
            self.client.wait_for_workers(self.devices)
        if line := dashboard_line(self.client):       # stdout is a command's output's
            print(line, file=sys.stderr, flush=True)
        return self

    def _local_cluster(self, LocalCluster):
        """One single-threaded worker process per device, each given its own GPU (one of
        this machine's, by ``CUDA_VISIBLE_DEVICES``: ``rpeg.runtime.dask.devices``) or none, and
        a memory limit that fits its device's host-side needs (:func:`worker_memory_limit`)."""
        import copy

        from rpeg.runtime.dask.devices import visible_gpus, worker_environments
        visible = visible_gpus()
        cuda = self.cuda
        if cuda is None and 0 < len(visible) < self.devices:
            print(f"rpeg: this machine shows {len(visible)} GPU(s) for a plan of "
                  f"{self.devices} devices: its workers run on CPU", file=sys.stderr)
            cuda = False
        envs = worker_environments(self.devices, cuda, visible)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                               resources={"GPU": 1}, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL,
                               memory_limit=worker_memory_limit(total, self.devices,
                                                                self.host_bytes))
        for d, env in enumerate(envs):
            spec = copy.deepcopy(cluster.new_spec)
            spec["options"]["env"] = {**spec["options"].get("env", {}), **env}
            cluster.worker_spec[f"device-{d}"] = spec
        cluster.sync(cluster._correct_state)
        return cluster

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
        return device_workers(self.client, n, remote=bool(self.scheduler))


def _connect(scheduler: str):
    from distributed import Client
    try:
        return Client(scheduler, timeout=10)
    except OSError as e:
        raise RuntimeFailure(f"scheduler {scheduler} must be reachable, and it is not ({e})",
                             hint="start it with `dask scheduler` and workers with `dask "
                                  "worker ADDR --nthreads 1 --resources GPU=1`") from e


def device_workers(client, n: int, *, remote: bool = True, needs: str = "the plan"
                   ) -> dict[int, str]:
    """Device index -> the address of the worker that runs it: the first ``n`` workers
    with resource GPU=1; RuntimeFailure when the cluster has fewer, or one runs more than
    one thread."""
    info = client.scheduler_info(n_workers=-1)["workers"] if remote else \
        client.scheduler_info()["workers"]
    gpu = sorted(a for a, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1)
    if len(gpu) < n:
        raise RuntimeFailure(f"{needs} needs {n} workers with resource GPU=1, and the "
                             f"cluster has {len(gpu)}",
                             hint="start one worker per device with --resources GPU=1, or "
                                  "plan for this many devices (--cluster)")
    # One thread per device worker is what keeps two ops off one device at once, so op
    # tasks need not request the resource (resource-restricted tasks take a slower path
    # through the scheduler: about twice the dispatch gap, measured on this machine).
    for a in gpu[:n]:
        threads = info[a].get("nthreads", 1)
        if threads != 1:
            raise RuntimeFailure(f"worker {a} must run 1 thread, not {threads}",
                                 hint="start device workers with --nthreads 1")
    return dict(enumerate(gpu[:n]))


def check_scheduler(scheduler: str, devices: int, needs: str = "the plan") -> None:
    """Refuse a scheduler with fewer device workers than ``devices`` before anything is
    planned or started (a search on a cluster it cannot run is time lost): connect, count,
    disconnect."""
    client = _connect(scheduler)
    try:
        device_workers(client, devices, needs=needs)
    finally:
        client.close()


class StepProgress:
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
