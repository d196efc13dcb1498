"""The control plane's time a step: rpeg's client and Dask's scheduler, priced per op call,
per task, per task argument and per worker.

    >>> terms = ControlTerms(call_s=30e-6, client_task_s=400e-6, client_arg_s=20e-6,
    ...                      client_worker_s=100e-6, scheduler_task_s=1e-3,
    ...                      scheduler_arg_s=50e-6, scheduler_worker_s=200e-6,
    ...                      heartbeat_s=300e-6)
    >>> t = control_time(terms, Dispatch(devices=1536, calls=5600, tasks=5600, args=24000),
    ...                  step_s=27.0)
    >>> round(t.client_s, 2), round(t.scheduler_s, 2), round(t.charged_s, 2)
    (3.04, 8.54, 8.54)
    >>> heartbeats_per_s(8), round(heartbeats_per_s(2048), 1)
    (16.0, 182.2)

rpeg drives every device from one client through one Dask scheduler
(``rpeg.runtime.dask.segments``):

* the client runs the scheduling core and the fusion for every op call
  (``rpeg.runtime.core.scheduler``, ``rpeg.runtime.core.fusion``: ``call_s``), and Dask's
  client submits
  every task with the futures it reads (``client_task_s``, ``client_arg_s``) and hears of
  each one's end; each step it drains every worker's trace events (``client_worker_s``);
* the scheduler moves each task through its states and resolves each argument (who holds
  it, whether the worker must fetch it: ``scheduler_task_s``, ``scheduler_arg_s``), relays
  the trace drain to every worker each step (``scheduler_worker_s``), and takes the
  workers' heartbeats, which Dask spaces so that at most about 200 arrive a second
  (:func:`heartbeats_per_s`, ``heartbeat_s`` each).

Each is one Python thread. A wave of tasks that becomes ready together — a train op's
ranks, the chunks behind a rollout, a weight sync's receivers — starts only as fast as
they handle it, one task after another, and the two work as a pipeline (the client a
task ahead of the scheduler). So the slower of the two is charged to the step in full
(``charged_s``): exact for a synchronous step whose waves all lie on its critical path,
an upper bound where steps overlap. Above ``SHARE_LIMIT`` of the step, :func:`verdict`
says so and what to do (past the step's own work, one scheduler cannot keep up at all).

On a machine whose devices are the host's own cores (the CPU profile sets ``host_cores``)
the control plane competes with the ops for those cores instead, and costs its CPU spread
over them (:func:`shared_cores_time`, from the per-device and per-task terms ``rpeg
calibrate`` fits on real runs, and the idle cluster's CPU per second it measures).

The terms are measured: ``rpeg calibrate`` measures them on the machine it runs on
(``rpeg.runtime.calibrate.dispatch.measure_scheduler`` with many lightweight workers, and the
scheduling core on a simulated clock); a GPU profile without them takes the shipped CPU
profile's, measured on the machine named in its source (:func:`terms_of`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import attrs

from rpeg.spec.model import GpuProfile

JOIN_MIN = 8            # a gang of this many ranks waits through one join (runtime.lowering.joins)
SHARE_LIMIT = 0.03      # a control plane above this share of the step is reported
T = TypeVar("T")        # a gang's call, or the device it runs on
D = TypeVar("D")        # a device


def through_join(ranks: int) -> bool:
    """Whether a gang (a collective's ranks, each a task) of ``ranks`` ranks waits through
    one join call, each rank on the join (``rpeg.runtime.lowering.joins``), rather than each
    on every rank of the gang before it: from :data:`JOIN_MIN` ranks.

        >>> through_join(JOIN_MIN - 1), through_join(JOIN_MIN)
        (False, True)
    """
    return ranks >= JOIN_MIN


def join_of(devices: Sequence[T]) -> T | None:
    """The device of the join a gang whose ranks run on ``devices`` (in rank order) waits
    through, its first rank's, where it reads the gang's inputs; None for a gang under
    :data:`JOIN_MIN` ranks, whose ranks each wait for themselves. The one rule the runtime
    makes a join by (``rpeg.runtime.lowering.joins.join_gang``) and the cost model counts
    where a gang reads by (``rpeg.plan.tasks.laid_out``).

        >>> join_of((4, 5)), join_of(tuple(range(3, 3 + JOIN_MIN)))
        (None, 3)
    """
    return devices[0] if through_join(len(devices)) else None


def waiting_before(ranks: Sequence[T], join: T | None) -> Sequence[T]:
    """Those of a gang's calls (its ``ranks`` and its ``join``, None where it has none:
    :func:`join_of`) that wait for the gang before on each member's device, in the one
    order of collectives: the join alone, where there is one, else every rank. The one rule
    the runtime orders gangs by (``rpeg.runtime.lowering.ordering.order_collectives``) and
    the cost model counts the futures ordering a gang by (``rpeg.plan.tasks``).

        >>> waiting_before(("r0", "r1"), None), waiting_before(("r0", "r1"), "j")
        (('r0', 'r1'), ('j',))
    """
    return ranks if join is None else (join,)


def gangs_before(devices: Iterable[D], last_on: Mapping[D, T]) -> list[T]:
    """What each of a gang's calls waiting for the gang before (:func:`waiting_before`)
    waits for, its members on ``devices``: on each member's device the last call of a gang
    before it in the one order of collectives (``last_on``: device -> that call, where one
    ran), once each. The one rule the runtime chains each device's gangs by
    (``rpeg.runtime.lowering.ordering.order_collectives``) and the cost model counts the
    futures ordering a gang by (``rpeg.plan.tasks.gang_calls``).

        >>> gangs_before((0, 1, 0, 2), {0: "a/r0", 1: "b/r1"})
        ['a/r0', 'b/r1']
    """
    return list(dict.fromkeys([last_on[d] for d in devices if d in last_on]))


@attrs.frozen
class ControlTerms:
    """CPU seconds of the client and the scheduler, per unit (see the module doc)."""

    call_s: float = 0.0               # client: scheduling core and fusion, per op call
    client_task_s: float = 0.0        # client: Dask's submission and completion, per task
    client_arg_s: float = 0.0         # client: per future a task takes
    client_worker_s: float = 0.0      # client: per worker per step (the trace drain)
    scheduler_task_s: float = 0.0     # scheduler: per task
    scheduler_arg_s: float = 0.0      # scheduler: per future a task takes
    scheduler_worker_s: float = 0.0   # scheduler: per worker per step (the drain's relay)
    heartbeat_s: float = 0.0          # scheduler: per worker heartbeat

    @property
    def measured(self) -> bool:
        return self.scheduler_task_s > 0 or self.client_task_s > 0

    @classmethod
    def of(cls, p: GpuProfile) -> ControlTerms:
        return cls(p.control_call_s, p.client_task_s, p.client_arg_s, p.client_worker_s,
                   p.scheduler_task_s, p.scheduler_arg_s, p.scheduler_worker_s,
                   p.scheduler_heartbeat_s)


@attrs.frozen
class Dispatch:
    """What one steady step asks of the control plane."""

    devices: int                      # workers taking part
    calls: int                        # op calls (joins included)
    tasks: int                        # Dask tasks they are fused into
    args: int                         # futures those tasks take as arguments, together


@attrs.frozen
class ControlTime:
    client_s: float                   # the client's CPU a step
    scheduler_s: float                # the scheduler's CPU a step
    charged_s: float                  # what the step pays (the slower of the two)


def heartbeats_per_s(workers: int) -> float:
    """Heartbeats the scheduler takes a second from ``workers`` workers: each sends one
    every ``distributed.scheduler.heartbeat_interval(n)`` seconds (0.5 s up to 10 workers,
    1 s under 50, 2 s under 200, then n / 200 + 1 s, so never much over 200 a second)."""
    n = workers
    interval = 0.5 if n <= 10 else 1.0 if n < 50 else 2.0 if n < 200 else n / 200 + 1
    return n / interval


def control_time(terms: ControlTerms, d: Dispatch, step_s: float) -> ControlTime:
    """The client's and the scheduler's CPU in a step of ``step_s`` seconds (its op time)
    that dispatches ``d``, and the time charged to it (see the module doc)."""
    client = (terms.call_s * d.calls + terms.client_task_s * d.tasks
              + terms.client_arg_s * d.args + terms.client_worker_s * d.devices)
    scheduler = (terms.scheduler_task_s * d.tasks + terms.scheduler_arg_s * d.args
                 + terms.scheduler_worker_s * d.devices
                 + terms.heartbeat_s * heartbeats_per_s(d.devices) * max(step_s, 0.0))
    return ControlTime(client, scheduler, max(client, scheduler))


def shared_cores_cpu(p: GpuProfile, devices: int, tasks: int, step_s: float = 0.0) -> float:
    """CPU seconds the control plane spends in a step of ``step_s`` seconds on a machine
    whose devices are the host's own cores: ``control_step_s`` per device (the trace drain,
    each worker's share of a step's bookkeeping) and ``control_task_s`` per Dask task a step,
    and ``control_idle`` (CPU seconds per second, a fraction of a core) for each of the
    cluster's processes, the client's and every device worker's, for as long as the step
    lasts (heartbeats, the workers' monitors, the dashboard: what an idle cluster burns).

        >>> p = GpuProfile("cpu", control_step_s=0.01, control_task_s=0.004,
        ...                control_idle=0.02)
        >>> round(shared_cores_cpu(p, 2, 8, step_s=0.1), 4)      # 0.02 + 0.032 + 0.006
        0.058
    """
    return (p.control_step_s * devices + p.control_task_s * tasks
            + p.control_idle * (devices + 1) * max(step_s, 0.0))


def shared_cores_time(p: GpuProfile, devices: int, tasks: int, nodes: int = 1,
                      step_s: float = 0.0) -> float:
    """Seconds a step of ``step_s`` seconds of work loses where the control plane shares
    the devices' cores (a CPU machine: ``host_cores``): its CPU (:func:`shared_cores_cpu`)
    spread over the cores of the ``nodes`` hosts. The idle cluster's CPU runs through the
    time lost too: the ``x`` with ``x = cpu(step_s + x) / cores``.

        >>> p = GpuProfile("cpu", host_cores=2, control_step_s=0.01, control_task_s=0.004,
        ...                control_idle=0.02)
        >>> x = shared_cores_time(p, 2, 8, step_s=0.1)
        >>> round(x, 6) == round(shared_cores_cpu(p, 2, 8, step_s=0.1 + x) / 2, 6)
        True
    """
    cores = p.host_cores * max(1, nodes)
    idle = p.control_idle * (devices + 1)
    return shared_cores_cpu(p, devices, tasks, step_s) / max(cores - idle, 1e-9)


def share(control_s: float, step_s: float) -> float:
    """The control plane's part of a step of ``step_s`` seconds that includes it."""
    return control_s / step_s if step_s > 0 else 0.0


def verdict(control_s: float, step_s: float, tasks: int, devices: int) -> str | None:
    """Why the control plane is too large a part of a step (``step_s``, which includes its
    ``control_s``), with what to do; None below ``SHARE_LIMIT``.

        >>> print(verdict(0.5, 27.0, 5600, 1536))
        None
        >>> print(verdict(6.0, 27.0, 5600, 1536))
        the control plane takes 22.2% of the step: one client and one Dask scheduler dispatch 5,600 tasks a step to 1,536 devices; plan fewer chunks or fewer data-parallel ranks (larger tasks), or run the devices as several smaller jobs
    """
    part = share(control_s, step_s)
    if part <= SHARE_LIMIT:
        return None
    text = (f"the control plane takes {100 * part:.1f}% of the step: one client and one Dask "
            f"scheduler dispatch {tasks:,} tasks a step to {devices:,} devices")
    if control_s > step_s - control_s:
        text += ", more than the step's own work (one scheduler cannot keep up)"
    return text + ("; plan fewer chunks or fewer data-parallel ranks (larger tasks), or run "
                   "the devices as several smaller jobs")


@functools.cache
def _shipped_host() -> GpuProfile:
    from rpeg.cost.profiles import builtin_profile
    return builtin_profile("local_cpu")


def terms_of(p: GpuProfile) -> tuple[ControlTerms, str]:
    """The control-plane terms for a cluster of ``p`` devices, and whose they are: each the
    profile's own where it gives it (above 0: ``rpeg calibrate`` on the host that runs the
    client and the scheduler, or a figure written in), else the shipped CPU profile's."""
    own, host = ControlTerms.of(p), _shipped_host()
    fields = attrs.fields(ControlTerms)
    given = {f.name: getattr(own, f.name) for f in fields if getattr(own, f.name) > 0}
    whose = p.name if len(given) == len(fields) else host.name if not given \
        else f"{p.name} and {host.name}"
    return attrs.evolve(ControlTerms.of(host), **given), whose
