"""One op call: one device's share of an instance of the placed graph, as a frozen value
the lowering's passes (``rpeg.runtime.lowering.ordering``) take and return.

    >>> c = OpCall("train/s0/r1", "train", OpKind.TRAIN, step=0, device=1, rank=1, world=2)
    >>> c.instance, c.collective, c.all_deps
    (Instance(op='train', step=0, chunk=0), True, ())
"""

from __future__ import annotations

import attrs

from rpeg.graph import Instance
from rpeg.graph.ids import OpId
from rpeg.plan.oplayout import ranks_together
from rpeg.runtime.lowering.replicas import CallRole, ReplicaKey
from rpeg.spec.model import OpKind


@attrs.frozen
class OpCall:
    """One op instance: everything a worker needs to run it, as plain data."""

    id: OpId = attrs.field(converter=OpId)   # its text: the call's key in records and traces
    op: str                                  # graph op: a stage, fused trainers, or sync_<model>
    kind: OpKind
    step: int
    device: int
    chunk: int = 0
    chunks: int = 1                          # instances of this op in a step (chunks or ranks)
    parts: int = 0                           # > 0: it runs on part ``chunk`` of ``parts`` of
                                             # the whole batch its inputs make (a pass split
                                             # over its data-parallel blocks)
    rank: int = 0
    world: int = 1                           # data-parallel degree
    tp_group: tuple[int, ...] = ()           # devices running this instance together (tp > 1;
                                             # a weight sync's senders and engine hosts)
    role: CallRole = attrs.field(default=CallRole.NONE, converter=CallRole)   # sync, join
    gang: tuple[int, ...] = ()               # sync ops: every device of the weight transfer
    sources: tuple[int, ...] = ()            # sync ops: the trainer's devices that send
    fills: tuple[str, ...] = ()              # sync ops: copies on this device it loads
    # the copy of a backbone whose state the op reads or writes
    model: ReplicaKey | None = attrs.field(default=None, converter=ReplicaKey.maybe)
    stages: tuple[str, ...] = ()             # spec stages it implements
    inputs: tuple[tuple[str, int], ...] = () # data name -> futures in ``deps``, in order
    deps: tuple[str, ...] = ()               # data dependencies (op ids), in argument order
    after: tuple[str, ...] = ()              # ordering dependencies (no data used)
    version: int = -1                        # parameter version read (-1: none)
    writes: int = -1                         # parameter version written (-1: none)
    bound: int = 0                           # the plan's staleness: version >= step - bound
    limit: int = 0                           # the spec's bound on it (carry included)
    carry: int = 0                           # generate: responses span up to carry + 1 steps
                                             # (a chunk's oldest token: step - bound - carry)

    @property
    def all_deps(self) -> tuple[str, ...]:
        return self.deps + self.after

    @property
    def instance(self) -> Instance:
        """The instance of the placed graph (``rpeg.plan.lower.Placed.edges``) this call is
        one device's share of: a rank of a train op or a tensor-parallel block, a weight
        sync's export, load, send or receive, a gang's join."""
        return Instance(self.op, self.step, 0 if self.kind is OpKind.SYNC_WEIGHTS
                        else self.chunk)

    @property
    def collective(self) -> bool:
        """Runs collectives with other workers: a rank of a tensor-parallel block or of a
        data-parallel train op. Its ranks start together (``ordering.order_collectives``)."""
        return bool(self.tp_group) or bool(self.gang) or ranks_together(self.kind, self.world)
