"""What every worker is told once, at set-up: the run's spec, plan, and its own place in it.

    >>> ctx = RunContext.create(pipeline, plan, calls, run_dir="runs/x")  # doctest: +SKIP
    >>> ctx.replicas_on(0)                                                             # doctest: +SKIP
    (Replica(model='actor', device=0, heads=('lm',), trainable=True), ...)

The replicas are the placed graph's (``rpeg.plan.lower.Placed.replicas``: each copy's
layout, engine block and training), those the run's calls read; the weight syncs into
vLLM engines its engine syncs (``Placed.engine_syncs``), those the calls send.
Model state is created on a worker once, from this, and lives there for the
whole run; op calls then carry only their own small description and the
futures of their data.
"""

from __future__ import annotations

import attrs
import numpy as np

from rpeg.cost.passes import train_groups
from rpeg.graph.layout import LAYOUT, Layout
from rpeg.plan.model import Plan
from rpeg.runtime.dask.devices import COLLECTIVE_TIMEOUT_S, GpuOf
from rpeg.runtime.data import Cursor
from rpeg.runtime.lowering.instances import (
    EXPORT,
    SEND,
    OpCall,
    ReplicaKey,
    base_of,
    placed_for,
    train_layouts,
)
from rpeg.spec.model import Head, Pipeline


@attrs.frozen
class Replica:
    """One copy of a backbone's state on one device."""

    model: ReplicaKey = attrs.field(converter=ReplicaKey)   # "actor", "actor+critic~vllm"
    device: int
    heads: tuple[str, ...]           # "lm", "value"
    trainable: bool                  # holds an optimizer (a home device of a trained model)
    world: tuple[int, ...] = ()      # devices training it (dp x tp; len > 1: collectives)
    tp: tuple[int, ...] = ()         # its tensor-parallel group (len > 1: weights sharded)
    layout: Layout = LAYOUT          # trained: its trainer's (ZeRO level: DDP or FSDP2,
                                     # recomputation, optimizer offload)
    engine: tuple[int, ...] = ()     # a vLLM engine's own copy: the devices its workers span
    serves: str = ""                 # an engine's copy: the generate op whose batching it runs

    @property
    def layout_groups(self) -> tuple[tuple[int, ...], ...]:
        """Process groups training this replica needs (every rank creates all of a run's)."""
        if not self.trainable:
            return (self.tp,) if len(self.tp) > 1 else ()
        return train_groups(self.world, max(len(self.tp), 1), self.layout.zero)


@attrs.frozen
class WeightSync:
    """The collective weight sync of one trained model into the vLLM engines serving copies
    of it (``backends.vllm_backend.sync``; who takes part: ``rpeg.cost.engine_sync.sync_layout``):
    group rank 0 is the first sender, then the workers of each engine on devices of its own,
    hosts in order. An engine sharing a device with a sender is loaded by that sender, in
    its process (``local``), never through the group."""

    model: str
    senders: tuple[int, ...]         # every trainer device holding a piece: all gather
    engines: tuple[tuple[int, int], ...]   # (host device, workers of its engine): the group's
    addr: str = ""                   # tcp://host:port of the rendezvous (the first sender's)
    local: tuple[int, ...] = ()      # hosts of engines loaded in process by their sender
    timeout_s: float = COLLECTIVE_TIMEOUT_S   # the group's collectives wait this long

    @property
    def world(self) -> int:
        return 1 + sum(tp for _, tp in self.engines)

    def first_rank(self, host: int) -> int:
        """Group rank of the first worker of the engine on ``host``."""
        rank = 1
        for h, tp in self.engines:
            if h == host:
                return rank
            rank += tp
        raise KeyError(host)


@attrs.frozen
class RunContext:
    pipeline: Pipeline
    plan: Plan
    run_dir: str
    backend: str = "torch"
    replicas: tuple[Replica, ...] = ()
    num_devices: int = 1
    dist_addr: str = ""              # tcp://host:port of the collective rendezvous ("" = none)
    groups: tuple[tuple[int, ...], ...] = ()   # process groups, created on every rank in order
    use_cuda: bool = False
    threads: int = 1                 # intra-op threads per worker
    data: Cursor = Cursor()          # where the run reads its prompts from (a resume's)
    syncs: tuple[WeightSync, ...] = ()    # collective weight syncs into vLLM engines
    gpus: tuple[GpuOf, ...] = ()     # on CUDA: device -> the GPU its worker owns
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S   # then a collective fails
    tool_slots: int = 1              # tool calls a worker's sandbox runs at once

    @classmethod
    def create(cls, pipeline: Pipeline, plan: Plan, calls: tuple[OpCall, ...], *,
               run_dir: str, dist_addr: str = "", use_cuda: bool = False) -> RunContext:
        """The context of a run of ``calls``: the replicas they read (the placed graph's,
        :attr:`rpeg.plan.lower.Placed.replicas`: each one's layout, engine and training)
        and the weight syncs into vLLM engines they send."""
        placed = placed_for(pipeline, plan)
        trained = train_layouts(placed.graph, plan)
        homes = {t.model: placed.layout(t.trainer).devices for t in placed.transfers}
        used = {(c.model, c.device) for c in calls if c.model is not None}
        replicas = []
        for r in placed.replicas:
            if (r.key, r.device) not in used:
                continue
            p = trained.get(r.key) if r.trained else None
            replicas.append(Replica(
                r.key, r.device, tuple(sorted(heads_of(pipeline, r.key))), trainable=r.trained,
                world=homes[r.key] if r.trained else (), tp=r.group,
                layout=p.layout if p else LAYOUT, engine=r.engine, serves=r.serves))
        made = {g for r in replicas for g in r.layout_groups}
        for c in calls:                    # a weight transfer: its broadcast group
            if c.gang and c.role == EXPORT and c.device == c.sources[0]:
                made.add(transfer_group(c))
        sent = {c.model for c in calls if c.role == SEND}
        syncs = []
        for model, lay in sorted(placed.engine_syncs):   # those this run's calls send
            if model in sent and (lay.group or lay.local):
                syncs.append(WeightSync(model, lay.senders,
                                        tuple((b[0], len(b)) for b in lay.group),
                                        local=tuple(b[0] for b in lay.local)))
        return cls(pipeline, plan, run_dir, replicas=tuple(replicas),
                   num_devices=plan.num_devices, dist_addr=dist_addr, use_cuda=use_cuda,
                   groups=tuple(sorted(g for g in made if g)), syncs=tuple(syncs))

    def sync_of(self, model: str) -> WeightSync:
        return next(s for s in self.syncs if s.model == model)

    def replicas_on(self, device: int) -> tuple[Replica, ...]:
        return tuple(r for r in self.replicas if r.device == device)

    @property
    def needs_collectives(self) -> bool:
        return bool(self.groups) or self.replicas_collective

    @property
    def replicas_collective(self) -> bool:
        """Whether training or splitting a model takes collectives (not weight sync alone,
        which an in-process run does without them)."""
        return any(r.layout_groups for r in self.replicas)


def transfer_group(call: OpCall) -> tuple[int, ...]:
    """The devices a weight transfer broadcasts over: its first source, then every device
    that is not a source (empty when every loading device is a source)."""
    rest = tuple(d for d in call.gang if d not in call.sources)
    return (call.sources[0],) + rest if rest else ()


def heads_of(pipeline: Pipeline, backbone: str) -> set[str]:
    """The heads a replica of ``backbone`` (one model, or models sharing it) carries."""
    heads = set()
    for name in base_of(backbone).members:
        m = pipeline.model(name)
        heads.add("lm" if m.head is Head.LM else "value")
    return heads


# --- workload data (rpeg.runtime.data reads the rows) ---------------------------------------
def group_of(prompt_index: np.ndarray, samples: int) -> np.ndarray:
    """The prompt (group) each response belongs to."""
    return np.asarray(prompt_index) // max(samples, 1)



def tool_slots(plan: Plan) -> int:
    """Tool calls a worker's sandbox runs at once: its device's share of its node's tool
    cores, as the plan's cluster declares them (``tool_cores``) and the cost model priced
    them; 1 where the plan names no cluster file that can be read."""
    if not plan.cluster_path:
        return 1
    try:
        from rpeg.spec import load_cluster
        cluster = load_cluster(plan.cluster_path)
    except Exception:            # noqa: BLE001 -- a plan moved from its cluster: the default
        return 1
    return max(cluster.tool_cores_per_node // max(cluster.gpus_per_node, 1), 1)
