"""The process a measurement runs in: its allocator, its threads, its memory readings.

    >>> with PeakMemory() as mem:                                   # doctest: +SKIP
    ...     x = torch.ones(2**20)
    >>> mem.peak >= 4 * 2**20                                       # doctest: +SKIP
    True

One device is one process computing with one thread (``set_threads``). Times are taken
under the allocator settings of rpeg's workers (glibc defaults), peaks under
``MALLOC_ENV`` (``spawning`` starts Dask workers with either); ``PeakMemory`` reads the
resident-set high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rpeg.cost.calibrate import MALLOC_ENV

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


__all__ = ["DTYPES", "ROOT", "PeakMemory", "set_threads", "spawning"]
