"""Measurements of this machine's devices, for ``rpeg calibrate`` and the accuracy benchmark.

    $ python -m backends.torch_backend.measure calibrate > m.json

    >>> t = gemm_seconds(256, 256, 256, repeats=3)           # doctest: +SKIP
    >>> op = measure_op("forward", PRESETS["tiny"], batch=4, prompt_len=16, gen_len=16)  # doctest: +SKIP
    >>> op["latency_s"], op["peak_bytes"]                     # doctest: +SKIP

What each module measures: ``measure_probes`` the device (GEMM rates, bandwidths, an
optimizer step), ``measure_host`` the host ops (rewards, advantages, per-response work),
``measure_model`` model ops (timing, peak memory), ``measure_devices`` two Dask worker
processes joined by gloo (all-reduce, concurrency, data-parallel train ops), with
``measure_env`` the process they run in; this module is the calibration set and what
``rpeg calibrate`` runs, and re-exports their public names.

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

import json
import os
import sys
import time

import torch

from backends.torch_backend.measure_devices import TwoDevices
from backends.torch_backend.measure_env import PeakMemory, set_threads
from backends.torch_backend.measure_host import (
    HOST_SHAPES,
    HOST_STAGES,
    host_ops,
    model_host_per_sample,
)
from backends.torch_backend.measure_layouts import dp_train_rows, tp_rows
from backends.torch_backend.measure_model import (
    measure_op,
    measure_ops,
    measure_peaks,
    op_runner,
    peaks_in_child,
    spec_from_json,
    spec_json,
    warm_up,
)
from backends.torch_backend.measure_probes import (
    copy_bandwidth,
    gemm_seconds,
    gemm_sweep,
    optimizer_seconds,
    probe_bytes,
    stream_bandwidth,
)
from backends.torch_backend.sharding import LEVELS
from rpeg.cost.calibrate import MALLOC_ENV, allocator, worker_env
from rpeg.spec.presets import PRESETS, ModelDims

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
    # a decode step's sampling on the engine's code path (its fixed part and per logit)
    from backends.torch_backend.measure_sampling import sampling_rows
    out["sampling"] = sampling_rows(repeats)
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


# Train ops data-parallel over the two devices under each ZeRO level the runtime executes
# (DDP; FSDP2 keeping the weights gathered, and resharding them), on models of 21 and 39
# parameter tensors: the profile's ``shard_tensor_overhead`` is fitted to the sharded ones,
# its ``shard_layer_overhead`` to them in one micro-batch and in two.
DP_TRAIN_OPS = tuple((name, CALIBRATION_DIMS[name], zero, b, p, g)
                     for name in ("tiny", "tiny4") for zero in LEVELS
                     for b, p, g in ((16, 32, 16), (48, 8, 20))) \
    + tuple((name, CALIBRATION_DIMS[name], zero, 16, 32, 16, 2)   # FSDP2 a micro-batch more
            for name in ("tiny", "tiny4") for zero in LEVELS if zero)
# Ops split over the two devices (tp = 2) on models of 2 and 4 layers: the profile's
# ``tp_layer_overhead`` is fitted to them (a forward, a decode and a train op per model).
TP_OPS = tuple((kind, name, CALIBRATION_DIMS[name], b, p, g) for name in ("tiny", "tiny4")
               for kind, b, p, g in (("forward", 16, 32, 32), ("generate", 48, 8, 20),
                                     ("train", 16, 32, 16), ("train", 48, 8, 20)))
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
        out["dp_train"] = dp_train_rows(two, DP_TRAIN_OPS, repeats)
        out["tp_ops"] = tp_rows(two, TP_OPS, repeats)
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


__all__ = ["ALLREDUCE_SIZES", "CALIBRATION_DIMS", "CALIBRATION_OPS", "DP_TRAIN_OPS", "GEMM_SHAPES",
           "HOST_SHAPES", "HOST_STAGES", "MALLOC_ENV", "PACKED_OPS", "PROBE_SPECS",
           "PeakMemory", "TwoDevices", "allocator", "bandwidths", "calibration_measurements",
           "calibration_specs", "copy_bandwidth", "gemm_seconds", "gemm_sweep", "host_ops",
           "machine_info", "measure_op", "measure_ops", "measure_peaks", "micro_measurements",
           "model_host_per_sample", "op_runner", "optimizer_seconds", "peaks_in_child",
           "probe_bytes", "set_threads", "spec_from_json", "spec_json", "stream_bandwidth",
           "warm_up"]
