"""Weight sync into a vLLM engine's own copy, through collectives, and when an engine has one.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> from rpeg.graph.layout import Layout
    >>> p = ppo_pipeline("llama3.1-8b", prompts=512)
    >>> m, r8 = p.model("actor"), tuple(range(8))
    >>> t = collective_sync_time(m, r8, Layout(dp=8), ((8, 9), (10, 11)), cluster_of("h200", 8, 2))
    >>> round(t, 2)                 # 16 GB of bf16 in 240 buckets over a 50 GB/s node link
    0.33

A generate stage on vLLM serves a copy of its own (``actor~vllm``) unless it runs at tp 1
beside its model's unsplit trained replica outside FSDP2 (ZeRO 0), which updates the
engine in memory
(:func:`serves_copy`, per engine; the runtime lays its calls and the cost model prices
the sync by it). Each version
reaches a copy as ``backends.vllm_backend.sync`` moves it: the trainer's weights in their
dtype, gathered whole first where the trainer splits them (tensor parallel, or ZeRO-3) by
every device holding a piece (:func:`sync_senders`: they all enter each gather), then
broadcast by the trainer's first rank to every worker of every engine on devices of its
own, one bucket of ``SYNC_BUCKET_BYTES`` at a time over the link the two device sets span
(a pipelined tree: a latency per tree level per bucket, the bytes once at the link's
bandwidth), and copied into each worker's shard at memory bandwidth. An engine sharing a
device with a sender never joins that group (NCCL refuses two ranks on one GPU): the sender
on its host loads it in process, through CUDA IPC handles on a GPU
(:func:`sync_layout`), priced as that copy alone.

    >>> sync_layout((0, 1), ((0,), (2, 3)))     # the engine on 0 in process, 2-3 in the group
    SyncLayout(senders=(0, 1), group=((2, 3),), local=((0,),))

How many sequences an engine decodes at once, and in how much of the device, is the
generation model's (:func:`rpeg.cost.generation.concurrency`, from a placement's
``max_num_seqs``, ``kv_fraction`` and ``cuda_graph``: :func:`rpeg.cost.generation.batching_of`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs

from rpeg.cost import compute as C
from rpeg.cost.generation import sync_bytes
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.graph.layout import Layout
from rpeg.spec.model import Cluster, Engine, Model, Zero

# the bytes a weight sync into vLLM engines moves at a time: priced here, and the bucket
# ``backends.vllm_backend`` sends (its ``weights.DEFAULT_BUCKET_BYTES`` is this value)
SYNC_BUCKET_BYTES = 64 << 20


def tp_blocks(devices, tp: int) -> tuple[tuple[int, ...], ...]:
    """A layout's devices as its blocks of ``tp`` consecutive devices (one tensor-parallel
    group each, or one vLLM engine's workers, the first its host).

        >>> tp_blocks((4, 5, 6, 7), 2), tp_blocks((0, 1), 1)
        (((4, 5), (6, 7)), ((0,), (1,)))
    """
    return _tp_blocks(tuple(devices), max(tp, 1))


@functools.lru_cache(maxsize=4096)      # layouts repeat across proposals
def _tp_blocks(devices: tuple[int, ...], tp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(devices[i:i + tp] for i in range(0, len(devices), tp))


def engine_hosts_of(dst) -> tuple[int, ...]:
    """The devices hosting a generate placement's vLLM engines: each block's first."""
    return _hosts(tuple(dst.devices), max(dst.tp, 1))


@functools.lru_cache(maxsize=4096)
def _hosts(devices: tuple[int, ...], tp: int) -> tuple[int, ...]:
    return devices[::tp]


def serves_copy(src, dst, device: int) -> bool:
    """Whether the vLLM engine of generate placement ``dst`` hosted on ``device`` serves a
    copy of its own that the trainer (``src``, None: the model is not trained) sends each
    version to: every engine but one at tp 1 on a device where the model is trained unsplit
    and outside FSDP2 (tp 1, pp 1, ZeRO 0), which is updated from those weights in memory.
    A ZeRO-2 trainer holds them whole too, but as FSDP2's parameters: an engine started
    beside one ended its worker at the first train op, so it gets its own copy.

        >>> from types import SimpleNamespace as P
        >>> g = P(devices=(0, 2), tp=1, engine=Engine.VLLM)
        >>> t = P(devices=(0, 1), tp=1, pp=1, zero=Zero(0))
        >>> [serves_copy(t, g, d) for d in g.devices], engine_copy(t, g)
        ([False, True], True)
    """
    return dst.engine is Engine.VLLM and not (
        dst.tp == 1 and src is not None and src.tp == 1 and src.pp == 1 and src.zero.replicated
        and device in _set(tuple(src.devices)))


@functools.lru_cache(maxsize=1024)
def _set(devices: tuple[int, ...]) -> frozenset[int]:
    return frozenset(devices)


def engine_copy(src, dst) -> bool:
    """Whether any vLLM engine of generate placement ``dst`` serves a copy of its own that
    the trainer (``src``) sends each version to (:func:`serves_copy`, over its hosts)."""
    if dst.engine is not Engine.VLLM or not dst.devices:
        return False
    if not (dst.tp == 1 and src is not None and src.tp == 1 and src.pp == 1
            and src.zero.replicated):
        return True                          # every engine serves a copy
    # at tp 1 each device hosts an engine: one off the trainer's devices serves a copy
    return not _set(tuple(dst.devices)) <= _set(tuple(src.devices))


@attrs.frozen
class SyncLayout:
    """Who takes part in one weight sync into vLLM engines (:func:`sync_layout`)."""

    senders: tuple[int, ...]                 # trainer devices that gather; the first sends
    group: tuple[tuple[int, ...], ...]       # engine blocks in the sync group (own devices)
    local: tuple[tuple[int, ...], ...]       # engine blocks loaded in process by their host

    @property
    def members(self) -> tuple[int, ...]:
        """The sync group's devices, in group rank order: the first sender, then each
        remote engine's workers."""
        return (self.senders[0],) + tuple(d for b in self.group for d in b)


def sync_senders(devices, tp: int, zero: Zero) -> tuple[int, ...]:
    """The trainer devices that read its weights whole for a sync, all together: its first
    tensor-parallel block (each tensor whole there between ops, as ZeRO 0 and FSDP2 at
    ZeRO-2 keep it), or every device when ZeRO-3 keeps only shards; every device holding a
    piece of a tensor enters its gather, so no gather waits for a rank that never comes."""
    return tuple(devices) if zero.shards_params else tuple(devices[:max(1, tp)])


def sync_layout(senders, blocks) -> SyncLayout:
    """Split engine ``blocks`` (each the devices one engine's workers span, the first its
    host) into those the sync group reaches and those sharing a device with a sender,
    which their host loads in process (one process group never holds two ranks on one
    device: NCCL refuses it). :func:`sync_refusal` says when a plan cannot be laid so."""
    near = set(senders)
    local = tuple(tuple(b) for b in blocks if not near.isdisjoint(b))
    group = tuple(tuple(b) for b in blocks if near.isdisjoint(b))
    return SyncLayout(tuple(senders), group, local)


def engine_sync_layout(src, dsts) -> SyncLayout:
    """Who takes part in the weight sync from a trainer placed as ``src`` into the vLLM
    engines of the generate placements ``dsts`` that serve a copy of their own
    (:func:`serves_copy`): the trainer's senders (:func:`sync_senders`) and each such
    engine's block, by host device (:func:`sync_layout`)."""
    return _engine_sync_layout(src, tuple(dsts))


@functools.lru_cache(maxsize=4096)      # placements repeat across proposals
def _engine_sync_layout(src, dsts) -> SyncLayout:
    blocks = {b[0]: b for dst in dsts for b in _serving(src, dst)}
    return sync_layout(sync_senders(src.devices, max(src.tp, 1), src.zero),
                       [blocks[h] for h in sorted(blocks)])


def _serving(src, dst) -> tuple[tuple[int, ...], ...]:
    """The blocks of generate placement ``dst`` whose engines serve a copy of their own
    (:func:`serves_copy` of each block's host: what it reads of the placements tested once,
    not once per block)."""
    if dst.engine is not Engine.VLLM:
        return ()
    blocks = tp_blocks(dst.devices, dst.tp)
    if dst.tp == 1 and src is not None and src.tp == 1 and src.pp == 1 \
            and src.zero.replicated:
        trained = _set(tuple(src.devices))     # an engine there is updated in memory
        return tuple(b for b in blocks if b[0] not in trained)
    return blocks


def sync_refusal(layout: SyncLayout) -> str | None:
    """Why a weight sync cannot run as laid out (two ranks of its group on one device, or
    an engine on a sender's device that no sender hosts), or None."""
    for b in layout.local:
        if b[0] not in layout.senders:
            return (f"the vLLM engine on devices {list(b)} shares a device with the trainer's "
                    f"sending devices {list(layout.senders)} and is hosted on device {b[0]}, "
                    "which does not send: it can be loaded neither in process nor through "
                    "a process group")
    members = layout.members
    twice = sorted({d for d in members if members.count(d) > 1})
    if twice:
        return (f"the weight sync's process group would hold two ranks on device(s) {twice} "
                "(NCCL refuses that)")
    return None


def engine_sleeps(engine_devices, trained_devices, devices_are_host: bool) -> bool:
    """Whether a vLLM engine sleeps between its generate ops (vLLM's sleep mode, level 1: its
    weights to host memory, its KV cache freed): on GPUs, where it shares
    a device with a trainer, which then has the memory for training. A CPU device's memory
    is the host's: nothing to free."""
    return not devices_are_host and bool(set(engine_devices) & set(trained_devices))


def sleep_wake_time(model: Model, tp: int, gpu) -> float:
    """Seconds a sleeping engine spends per step: its weights (its tensor-parallel share)
    out to host memory after generating and back before it generates again, each way at the
    device's host bandwidth."""
    return 2 * sync_bytes(model, gpu) / max(tp, 1) / gpu.host_bandwidth


def collective_sync_time(model: Model, src_devices: Sequence[int], src_par: Layout,
                         engines: tuple[tuple[int, ...], ...], cluster: Cluster,
                         bucket_bytes: int = SYNC_BUCKET_BYTES) -> float:
    """Seconds of one update from a trainer (``src`` layout) into the vLLM engines whose
    workers span ``engines`` (one device block each), as ``backends.vllm_backend.sync``
    moves it (see the module doc)."""
    src = tuple(src_devices)
    gpu = cluster.gpu
    topo = Topology.from_cluster(cluster)
    nbytes = sync_bytes(model, gpu)
    gather = 0.0
    split = src_par.tp * src_par.pp
    if split > 1:                            # whole tensors from the first block's pieces
        gather += collective_time(Collective.ALL_GATHER, nbytes, src[:split], topo)
    if src_par.zero.shards_params and src_par.dp > 1:
        gather += collective_time(Collective.ALL_GATHER, nbytes / split,
                                  src[::split][:src_par.dp], topo)
    lay = sync_layout(sync_senders(src, split, src_par.zero), engines)
    world = lay.members if lay.group else ()
    broadcast = 0.0
    if len(world) > 1:
        link = topo.link(topo.level_of(world))
        buckets = max(math.ceil(nbytes / bucket_bytes), 1)
        levels = math.ceil(math.log2(len(world)))
        broadcast = buckets * levels * link.latency + nbytes / link.bandwidth
    tp = max(len(b) for b in engines) if engines else 1
    load = 2 * nbytes / tp / gpu.mem_bandwidth + C.param_tensors(model.dims) * gpu.launch_overhead
    return gather + broadcast + load


__all__ = ["SYNC_BUCKET_BYTES", "SyncLayout", "collective_sync_time", "engine_copy",
           "engine_hosts_of", "engine_sync_layout", "engine_sleeps", "serves_copy", "sleep_wake_time", "sync_layout",
           "sync_refusal", "sync_senders", "tp_blocks"]
