"""This machine's profile for the embedded default: calibrated once per CPU, then cached.

    >>> MachineId("AMD EPYC 7B13 64-Core Processor", 2).key
    'amd-epyc-7b13-64-core-processor-2c'
    >>> calibrated_on(GpuProfile("cpu", source="rpeg calibrate on AMD EPYC (2 cores, load 1.4)"))
    MachineId(cpu='AMD EPYC', cores=2)

``rpeg run FILE.rpeg`` without ``--cluster`` or ``--scheduler`` plans for a local Dask
cluster on this machine, and prices its ops with a profile of this machine
(:func:`local_profile`, ``ProfileChoice.AUTO``): the one cached under
``~/.cache/rpeg/machines/<cpu>-<cores>c/`` (``$RPEG_CACHE_DIR`` instead of
``~/.cache/rpeg``), or, when there is none — the first run, or a run on another CPU —
one measured now by a short ``rpeg calibrate`` (:func:`calibrate_into`) and cached.
``ProfileChoice.SHIPPED`` plans with the shipped ``pipelines/clusters/local_cpu.rpeg``
instead, and says on which CPU it was measured, so its predictions are never presented
as this machine's; ``CALIBRATE`` measures again. The choice comes from ``rpeg run
--profile`` or ``$RPEG_LOCAL_PROFILE`` (the tests set ``shipped``: nothing they check may
depend on a calibration of the machine they run on).
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from rpeg.errors import BackendError, RpegError, RuntimeFailure
from rpeg.resources import clusters_dir, profiles_dir
from rpeg.spec.model import GpuProfile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CLUSTER = clusters_dir() / "local_cpu.rpeg"
SHIPPED_PROFILE = profiles_dir() / "local_cpu.rpeg"
CHOICE_ENV = "RPEG_LOCAL_PROFILE"
CACHE_ENV = "RPEG_CACHE_DIR"
# Timed calls per measurement of a first-use calibration, whose median each price is fitted
# to. A call now and then takes 35-50% more CPU than its neighbours (seen in back-to-back
# calibrations on a 2-core host: a generation of 0.032 s once took 0.042 s, a tiny4 one 0.049 s
# once 0.074 s); a median of 2 calls is their mean, and one such call moved it, and the
# whole profile's prices with it, by 10-25% from one calibration to the next. A median of 5
# ignores two such calls (the extra rounds cost ~2.5 s each).
QUICK_REPEATS = 5
# Steps of each of the control plane's three short runs (measured from step 5). The CPU a
# step spends outside ops varies by +-30% from step to step (0.02-0.045 s a device worker
# in a tiny_ppo run); fitted over the 11 steps of 16-step runs, the per-device and per-task
# terms priced tiny_ppo's split plan's control plane at 0.071 s a step in one calibration
# and 0.060 s in the next (the runs measured 0.070-0.080 s).
# 40 steps (35 measured, ~10 s more) is what `rpeg calibrate` runs.
QUICK_CONTROL_STEPS = 40
# What a calibration measures, numbered: a cached profile from an earlier one lacks terms
# the cost model now reads, so it is measured again (2: data-parallel train ops on two
# worker ranks, the profile's dp_tensor_overhead and shard_tensor_overhead; 3: the control
# plane's idle CPU, control_idle, and its per-device and per-task terms without checkpoints;
# 4: the devices' contention, concurrency_slowdown, over the ops the runs overlap, which the
# simulator now prices wherever ops overlap; 5: medians of QUICK_REPEATS = 5 calls, not 2,
# whose prices swung by 10-25% between calibrations, and control-plane runs of 40 steps;
# 6: a decode step's sampling measured by itself, the profile's decode_overhead and
# sample_logit_time, and the control plane's three runs twice each, in alternating order;
# 7: what a run's generate op pays per decode step beyond the price of its lengths, from the
# control plane's runs, added to decode_overhead: rpeg.runtime.calibrate.runs; 8: a
# checkpoint's write with its fsync and its writer's SHA-256, disk_bandwidth and
# hash_bandwidth: rpeg.runtime.calibrate.disk; 9: ops split tensor-parallel over two worker
# ranks, the profile's tp_layer_overhead; 10: FSDP2 train ops in two micro-batches too, its
# shard_layer_overhead; 11: the same measurements, fitted through a cost model that prices
# the torch engine's log-probabilities by the bytes they move, rpeg.cost.engines.LossTraffic,
# and recomputation without the head: the elementwise rate and the per-layer and per-call
# terms fitted before absorbed part of that traffic)
CALIBRATION = 11

__all__ = ["ProfileChoice", "MachineId", "LocalProfile", "local_profile", "calibrated_on",
           "choice_from_env", "cache_dir", "calibrate_into", "fit_machine", "measure_machine",
           "RUN_DECODE"]


class ProfileChoice(enum.Enum):
    AUTO = "auto"                # this machine's cached profile; calibrated once if none
    CALIBRATE = "calibrate"      # measure this machine again now, and cache it
    SHIPPED = "shipped"          # the shipped profile, measured on another machine: said so


@attrs.frozen
class MachineId:
    """What a CPU profile depends on: the CPU model and how many cores share the devices."""

    cpu: str
    cores: int

    @classmethod
    def here(cls, cpuinfo: str | Path = "/proc/cpuinfo") -> MachineId:
        cpu = ""
        try:
            with open(cpuinfo, encoding="utf-8", errors="replace") as f:
                cpu = next((line.split(":", 1)[1].strip() for line in f
                            if line.startswith("model name")), "")
        except OSError:
            pass
        return cls(cpu or platform.processor() or platform.machine() or "unknown CPU",
                   os.cpu_count() or 1)

    @property
    def key(self) -> str:
        """A folder name: the CPU model in lower-case words, and the core count."""
        words = re.sub(r"[^a-z0-9]+", "-", self.cpu.lower()).strip("-") or "cpu"
        return f"{words[:80]}-{self.cores}c"

    def __str__(self) -> str:
        return f"{self.cpu}, {self.cores} cores"


_SOURCE = re.compile(r"rpeg calibrate on (?P<cpu>.+?) \((?P<cores>\d+) cores")


def calibrated_on(profile: GpuProfile) -> MachineId | None:
    """The machine a profile written by ``rpeg calibrate`` was measured on (None for one
    not written by it, such as the GPU profiles of published measurements)."""
    m = _SOURCE.search(profile.source or "")
    return MachineId(m["cpu"], int(m["cores"])) if m else None


@attrs.frozen
class LocalProfile:
    """The cluster file the embedded default plans with, and what to tell the user."""

    cluster: Path
    machine: MachineId                  # this machine
    measured_on: MachineId | None       # where the profile's figures were measured
    note: str

    @property
    def this_machines(self) -> bool:
        return self.measured_on == self.machine


def cache_dir() -> Path:
    """Where machine profiles are cached: $RPEG_CACHE_DIR, else $XDG_CACHE_HOME/rpeg,
    else ~/.cache/rpeg."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rpeg"


def choice_from_env(value: str | None = None) -> ProfileChoice:
    """``value`` (default: $RPEG_LOCAL_PROFILE, else auto) as a choice."""
    value = value if value is not None else os.environ.get(CHOICE_ENV, "auto")
    try:
        return ProfileChoice(value.strip().lower())
    except ValueError:
        raise RuntimeFailure(f"{CHOICE_ENV} must be auto, calibrate or shipped, not "
                             f"{value!r}") from None


Calibrator = Callable[[Path, Path], str]       # (profile path, cluster path) -> summary line


def local_profile(choice: ProfileChoice = ProfileChoice.AUTO, *,
                  machine: MachineId | None = None, calibrate: Calibrator | None = None,
                  say: Callable[[str], None] | None = None) -> LocalProfile:
    """The profile the embedded default prices ops with (see the module doc). ``calibrate``
    writes a profile and a cluster file of this machine (default :func:`calibrate_into`);
    ``say`` prints progress (default: to stderr)."""
    from rpeg.spec import load_cluster

    machine = machine or MachineId.here()
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if choice is ProfileChoice.SHIPPED:
        on = calibrated_on(load_cluster(SHIPPED_CLUSTER).gpu)
        if on == machine:
            note = (f"priced with the shipped CPU profile, measured on a machine like this "
                    f"one ({machine})")
        else:
            note = (f"note: predictions are priced with the shipped CPU profile, measured on "
                    f"{on or 'another machine'}, not on this machine ({machine}): they are "
                    f"not this machine's (--profile auto calibrates it)")
        return LocalProfile(SHIPPED_CLUSTER, machine, on, note)
    where = cache_dir() / "machines" / machine.key
    cluster = where / "local_cpu.rpeg"
    if choice is ProfileChoice.AUTO and _usable(where, machine):
        made = json.loads((where / "machine.json").read_text(encoding="utf-8"))["date"]
        return LocalProfile(cluster, machine, machine,
                            f"priced with this machine's profile ({machine}; calibrated "
                            f"{made}, {cluster})")
    say(f"calibrating this machine ({machine}) for the cost model: a few minutes, once "
        f"per CPU (--profile shipped skips it)")
    began = time.perf_counter()
    summary = _calibrate_cached(where, machine, calibrate or calibrate_into)
    say(f"calibrated in {time.perf_counter() - began:.0f} s: {summary}; cached in {where}")
    return LocalProfile(cluster, machine, machine,
                        f"priced with this machine's profile ({machine}; calibrated now, "
                        f"{cluster})")


def _usable(where: Path, machine: MachineId) -> bool:
    """Whether a cached profile of ``machine`` is there, loads, and measures what the
    current calibration does."""
    from rpeg.spec import load_cluster
    try:
        meta = json.loads((where / "machine.json").read_text(encoding="utf-8"))
        if (meta.get("cpu"), meta.get("cores")) != (machine.cpu, machine.cores):
            return False
        if meta.get("calibration", 1) < CALIBRATION:
            return False
        load_cluster(where / "local_cpu.rpeg")
    except (OSError, ValueError, KeyError, RpegError):
        return False
    return True


def _calibrate_cached(where: Path, machine: MachineId, calibrate: Calibrator) -> str:
    """Calibrate into a fresh folder beside ``where``, then put it in place whole (a run
    interrupted mid-calibration leaves no half-written profile)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{machine.key}-", dir=where.parent))
    summary = calibrate(tmp / "profile.rpeg", tmp / "local_cpu.rpeg")
    (tmp / "machine.json").write_text(json.dumps(
        {"cpu": machine.cpu, "cores": machine.cores, "calibration": CALIBRATION,
         "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "summary": summary}, indent=2) + "\n", encoding="utf-8")
    if where.exists():
        old = where.with_name(f".{machine.key}-old-{os.getpid()}")
        where.rename(old)
        tmp.rename(where)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(where)
    return summary


def measure_machine(repeats: int, control_steps: int = 40, scheduler: bool = False) -> dict:
    """Every measurement ``rpeg calibrate`` fits: the torch ops in a child process (under
    the workers' allocator settings), what one Dask task adds, and the control plane's CPU
    in three short real runs; with ``scheduler``, also what the control plane costs on a
    host of its own (Dask's scheduler and client with many lightweight workers, the
    scheduling core on a simulated clock), which GPU clusters are priced with. The process's
    environment is as it was before (:func:`rpeg.runtime.calibrate.dispatch.environ_kept`)."""
    from rpeg.runtime.calibrate.dispatch import environ_kept
    with environ_kept():       # the clusters it starts leave Dask's worker settings behind
        return _measure_machine(repeats, control_steps, scheduler)


def _measure_machine(repeats: int, control_steps: int, scheduler: bool) -> dict:
    from rpeg.cost.calibrate import worker_env
    from rpeg.runtime.calibrate.disk import measure_checkpoint_io
    from rpeg.runtime.calibrate.dispatch import measure_control, measure_dispatch, measure_scheduler
    from rpeg.runtime.calibrate.simulated import measure_core
    proc = subprocess.run([sys.executable, "-m", "backends.torch_backend.measure", "calibrate",
                           str(repeats)], capture_output=True, text=True, env=worker_env(),
                          cwd=ROOT)
    if proc.returncode != 0:
        raise BackendError("the calibration measurements must run, not fail: "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1],
                           hint="calibration needs the torch extra: pip install -e '.[torch]'")
    m = json.loads(proc.stdout)
    m["checkpoint_io"] = measure_checkpoint_io(cache_dir())   # the runs' filesystem
    m["dispatch"] = measure_dispatch()
    m["control"] = measure_control(steps=control_steps)
    if scheduler:
        m["scheduler"] = measure_scheduler()
        m["core"] = measure_core()
    return m


RUN_DECODE = "generate in runs, s per decode step"     # fit_machine's residual, by name


def fit_machine(m: dict, name: str = "local_cpu"):
    """``rpeg.cost.calibrate.fit_profile`` of ``measure_machine``'s measurements, with what
    a generate op pays per decode step in the control plane's real runs beyond its price
    added to ``decode_overhead`` (:mod:`rpeg.runtime.calibrate.runs`), and that residual
    among the fit's residuals."""
    from rpeg.cost.calibrate import fit_profile
    from rpeg.runtime.calibrate.runs import with_run_decode
    fit = fit_profile(m, name=name)
    if "control" not in m:
        return fit
    prof, extra = with_run_decode(fit.profile, fit.link, m["control"])
    if extra is None:
        return fit
    return attrs.evolve(fit, profile=prof, measured=fit.measured | {"decode_overhead"},
                        residuals=fit.residuals + ((RUN_DECODE, extra),))


def calibrate_into(profile_path: Path, cluster_path: Path, repeats: int = QUICK_REPEATS,
                   control_steps: int = QUICK_CONTROL_STEPS) -> str:
    """A short ``rpeg calibrate``: this machine's profile to ``profile_path`` and its local
    cluster to ``cluster_path`` (the shipped profile's fields it does not measure, the vLLM
    terms, are kept); returns a one-line summary."""
    from rpeg.cost.calibrate import cluster_text, keep_unmeasured
    from rpeg.cost.profiles import load_profile, profile_text
    fit = fit_machine(measure_machine(repeats, control_steps))
    p = keep_unmeasured(fit, load_profile(SHIPPED_PROFILE))
    profile_path.write_text(profile_text(p, comment=f"{p.name}: measured by rpeg calibrate"),
                            encoding="utf-8")
    cluster_path.write_text(cluster_text(p.name, os.path.relpath(profile_path,
                                                                 cluster_path.parent),
                                         fit.link), encoding="utf-8")
    return (f"GEMM {p.matmul_flops / 1e9:.0f} GFLOPS, copy {p.mem_bandwidth / 1e9:.0f} GB/s, "
            f"gloo {fit.link.bandwidth / 1e9:.2f} GB/s + {fit.link.latency * 1e6:.0f} us, "
            f"ops {p.concurrency_slowdown:.2f}x slower beside each other, "
            f"a layer split over two workers +{p.tp_layer_overhead * 1e3:.1f} ms a pass, "
            f"checkpoint write {p.disk_bandwidth / 1e9:.2f} GB/s, "
            f"SHA-256 {p.hash_bandwidth / 1e9:.2f} GB/s"
            + (f", a run's decode step {runs * 1e6:+.0f} us beyond its price"
               if (runs := dict(fit.residuals).get(RUN_DECODE)) is not None else ""))
