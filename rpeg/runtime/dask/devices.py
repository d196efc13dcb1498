"""One device per worker: which GPU each device worker owns, decided by one pure rule.

    >>> gpu_table({0: Seen("node-a", ("0", "1", "2", "3")), 1: Seen("node-a", ("0", "1", "2", "3")),
    ...            2: Seen("node-b", ("5",))})
    (GpuOf(index=0, gpu='0', host='node-a'), GpuOf(index=1, gpu='1', host='node-a'), GpuOf(index=0, gpu='5', host='node-b'))

A plan's device *d* is the *d*-th device worker (``rpeg.runtime.dask.driver``). A worker owns
exactly one GPU:

* the embedded cluster starts worker *d* with ``CUDA_VISIBLE_DEVICES`` naming one GPU of
  this machine (:func:`worker_environments`): it sees that one GPU, as ``cuda:0``;
* a worker attached with ``--scheduler`` either was started the same way (tutorial 05:
  ``CUDA_VISIBLE_DEVICES=i dask worker ... --resources GPU=1``) and sees one GPU, or sees
  all of its node's and takes the one at its rank among the node's device workers, in
  plan order (:func:`local_index`).

The backend then makes that GPU the worker's current device before it joins the process
group (``torch.cuda.set_device``, ``device_id`` to ``init_process_group``) and builds its
meshes on it: nothing defaults to GPU 0. A vLLM engine whose workers span a block of
devices sees the block's GPUs by the ids their node gives them (:attr:`GpuOf.gpu`), its
host's first, whatever each device worker itself sees.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import attrs

from rpeg.errors import RuntimeFailure

VISIBLE = "CUDA_VISIBLE_DEVICES"
COLLECTIVE_TIMEOUT_S = 1800.0     # a collective waits this long for its partners (the default
                                  # of rpeg run --collective-timeout), then fails


@attrs.frozen
class Seen:
    """What a device worker reports of itself: its host and the GPUs it sees, by the ids
    its node gives them (``CUDA_VISIBLE_DEVICES``'s entries, else 0..n-1)."""

    host: str
    gpus: tuple[str, ...] = ()


@attrs.frozen
class GpuOf:
    """The GPU a device worker owns: its index as the worker sees it, its node-level id."""

    index: int
    gpu: str
    host: str


def visible_gpus(environ: Mapping[str, str] | None = None, count: int | None = None
                 ) -> tuple[str, ...]:
    """The GPUs a process sees, by node-level id: ``CUDA_VISIBLE_DEVICES``'s entries when
    set (empty: none), else ``count`` of them (torch's ``device_count``) numbered from 0,
    else this machine's ``/dev/nvidiaN`` devices (no CUDA library loaded)."""
    env = os.environ if environ is None else environ
    if VISIBLE in env:
        return tuple(x.strip() for x in env[VISIBLE].split(",") if x.strip())
    if count is not None:
        return tuple(str(i) for i in range(count))
    try:
        names = os.listdir("/dev")
    except OSError:
        return ()
    return tuple(sorted((m.group(1) for n in names if (m := re.fullmatch(r"nvidia(\d+)", n))),
                        key=int))


def local_index(rank: int, visible: int) -> int:
    """The index (as the worker sees its GPUs) of the GPU the ``rank``-th device worker of
    a node owns, when it sees ``visible`` GPUs: its only one, or the one at its rank."""
    if visible < 1:
        raise RuntimeFailure("a device worker running on CUDA must see a GPU, and this one "
                             "sees none", hint="start it with CUDA_VISIBLE_DEVICES naming its "
                                               "GPU, or run on CPU (rpeg run --cpu)")
    if visible == 1:
        return 0
    if rank >= visible:
        raise RuntimeFailure(f"device worker {rank} of its node must own a GPU of its own, "
                             f"and the node's workers see only {visible}",
                             hint="start one worker per GPU, each with CUDA_VISIBLE_DEVICES "
                                  "naming its GPU (tutorial 05)")
    return rank


def gpu_table(seen: Mapping[int, Seen]) -> tuple[GpuOf, ...]:
    """Device -> the GPU its worker owns (devices 0..n-1): each worker's rank among its
    host's device workers, in device order, picks its GPU (:func:`local_index`). Two
    workers on one GPU are refused."""
    rank: dict[str, int] = {}
    out = []
    for d in range(len(seen)):
        s = seen[d]
        r = rank.get(s.host, 0)
        rank[s.host] = r + 1
        i = local_index(r, len(s.gpus))
        out.append(GpuOf(i, s.gpus[i], s.host))
    owners: dict[tuple[str, str], int] = {}
    for d, g in enumerate(out):
        if (g.host, g.gpu) in owners:
            raise RuntimeFailure(f"devices {owners[(g.host, g.gpu)]} and {d} must own GPUs of "
                                 f"their own, and both own GPU {g.gpu} of {g.host}",
                                 hint="give each worker its GPU with CUDA_VISIBLE_DEVICES")
        owners[(g.host, g.gpu)] = d
    return tuple(out)


def cuda_choice(asked: bool | None, gpus: Mapping[int, int]) -> bool:
    """Whether a run's ops run on CUDA, from what was asked (``--cuda`` True, ``--cpu``
    False, neither None) and how many GPUs each device worker can use: automatic when every
    worker has one; asked for, every worker must have one."""
    have = [d for d, n in sorted(gpus.items()) if n > 0]
    if asked is False:
        return False
    if asked is None:
        return bool(gpus) and len(have) == len(gpus)
    lack = [d for d in sorted(gpus) if gpus[d] < 1]
    if lack:
        raise RuntimeFailure(f"--cuda runs every op on a GPU, and the workers of devices "
                             f"{lack} have none that torch can use",
                             hint="start those workers on GPU machines with a CUDA build of "
                                  "torch, or run on CPU (rpeg run --cpu)")
    return True


def block_gpus(table: tuple[GpuOf, ...], block: tuple[int, ...]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the processes of an engine spanning ``block`` (its host
    first): the block's GPUs by node-level id, all on the host's node."""
    hosts = {table[d].host for d in block}
    if len(hosts) > 1:
        raise RuntimeFailure(f"the devices {list(block)} of one vLLM engine must be on one "
                             f"node, not on {sorted(hosts)}",
                             hint="place tensor-parallel engines within a node")
    return ",".join(table[d].gpu for d in block)


def worker_environments(devices: int, cuda: bool | None,
                        visible: tuple[str, ...]) -> list[dict[str, str]]:
    """The environment of each of the embedded cluster's ``devices`` workers: on CUDA, one
    GPU of ``visible`` each (more workers than GPUs is refused); on CPU (``cuda`` False, or
    None without GPUs), no GPU at all."""
    use = bool(visible) if cuda is None else cuda
    if not use:
        return [{VISIBLE: ""} if visible else {} for _ in range(devices)]
    if len(visible) < devices:
        raise RuntimeFailure(f"the plan needs {devices} devices, and this machine shows "
                             f"{len(visible)} GPU(s) for the embedded cluster's workers",
                             hint="plan for the GPUs there are, run on CPU (--cpu), or attach "
                                  "to a cluster with --scheduler")
    return [{VISIBLE: visible[d]} for d in range(devices)]


__all__ = ["COLLECTIVE_TIMEOUT_S", "GpuOf", "Seen", "VISIBLE", "block_gpus", "cuda_choice", "gpu_table", "local_index", "visible_gpus",
           "worker_environments"]
