"""Typed names of what the graph, the plan and the runtime share.

A :class:`Backbone` names one set of weights: a model's own, or those of the models a spec
lets share one backbone (``share actor, critic``: ``actor+critic``). It is built from its
members and asked for them; its text form is the name itself, which is what plan files,
run records, traces and replica keys write, so it keys dicts and compares equal to the
plain name read back from any of them.

    >>> b = Backbone.of(("actor", "critic"))
    >>> b, b.members, b.shared, Backbone("ref").members
    ('actor+critic', ('actor', 'critic'), True, ('ref',))
    >>> b == "actor+critic" and {"actor+critic": 1}[b] == 1
    True
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

SEPARATOR = "+"          # between the members of a shared backbone's name


class Backbone(str):
    """The name of one set of weights (a model's, or a shared backbone's)."""

    __slots__ = ()

    @classmethod
    def of(cls, members: Iterable[str]) -> Backbone:
        """The backbone ``members`` share (one member: that model's own)."""
        members = tuple(members)
        if not members or any(not m or SEPARATOR in m for m in members):
            raise ValueError(f"a backbone must join model names, not {members!r}")
        return cls(SEPARATOR.join(members))

    @classmethod
    def maybe(cls, name: str | None) -> Backbone | None:
        """``name`` as a Backbone; None (no model) and the empty name kept as they are."""
        return name if not name or type(name) is cls else cls(name)

    @property
    def members(self) -> tuple[str, ...]:
        """The models whose weights this is, in the order the spec shares them."""
        return tuple(str.split(self, SEPARATOR))

    @property
    def shared(self) -> bool:
        """More than one model trains and reads these weights."""
        return SEPARATOR in self


def fused_name(stages: Iterable[str]) -> str:
    """The name of the op that runs ``stages`` as one (a shared backbone's train stages):
    theirs joined as a backbone's members are, which plans, traces and the cost model's
    works all key it by.

        >>> fused_name(("actor_step", "critic_step"))
        'actor_step+critic_step'
    """
    return SEPARATOR.join(stages)


VARIANT = "~"          # "actor~tp0-1": a second copy of actor on a device, split another way
ENGINE = "vllm"        # "actor~vllm": the copy a vLLM engine serves (its own devices, or tp > 1)


class ReplicaKey(str):
    """Which copy of a backbone's weights an op call reads: the backbone's own name, or the
    name and a variant: ``actor~tp0-1`` (a second copy on a device, split another way),
    ``actor~vllm`` (the copy a vLLM engine serves alone). Its text is the key run records,
    checkpoints and the executors' replica tables use.

        >>> key = ReplicaKey.of("actor+critic", "tp0-1")
        >>> key, key.backbone.members, key.variant, key.engine
        ('actor+critic~tp0-1', ('actor', 'critic'), 'tp0-1', False)
        >>> engine_key("actor"), variant_key("actor", (0, 1)), variant_key("ref", ())
        ('actor~vllm', 'actor~tp0-1', 'ref~whole')
    """

    __slots__ = ()

    @classmethod
    def of(cls, backbone: str, variant: str = "") -> ReplicaKey:
        return cls(f"{backbone}{VARIANT}{variant}" if variant else backbone)

    @classmethod
    def maybe(cls, key: str | None) -> ReplicaKey | None:
        """``key`` as a ReplicaKey; None (no model) and the empty key kept as they are."""
        return key if not key or type(key) is cls else cls(key)

    @property
    def backbone(self) -> Backbone:
        return Backbone(self.partition(VARIANT)[0])

    @property
    def variant(self) -> str:
        """"" for the backbone's own copy."""
        return self.partition(VARIANT)[2]

    @property
    def engine(self) -> bool:
        """The copy a vLLM engine serves alone."""
        return self.variant == ENGINE


def engine_key(model: str) -> ReplicaKey:
    """The key of the copy of ``model`` a vLLM engine serves alone (``actor~vllm``)."""
    return ReplicaKey.of(model, ENGINE)


def variant_key(model: str, group: tuple[int, ...]) -> ReplicaKey:
    """The key of a second copy of ``model`` on a device, split over tp ``group``
    (``actor~tp0-1``; ``actor~whole``: unsplit)."""
    return ReplicaKey.of(model, "tp" + "-".join(map(str, group)) if group else "whole")


AT = "@"               # "actor~tp0-1@3": a replica, by its key and the device holding it


class ReplicaAt(str):
    """One replica in a checkpoint: the key of the copy and the device holding it
    (``actor~tp0-1@3``), its folder's name and its key in the checkpoint's state.

        >>> at = ReplicaAt.of(ReplicaKey.of("ref", "tp0-1"), 3)
        >>> at, at.key, at.key.backbone, at.device
        ('ref~tp0-1@3', 'ref~tp0-1', 'ref', 3)
        >>> ReplicaAt.parse("actor@x"), ReplicaAt.parse("actor@2").device
        (None, 2)
    """

    __slots__ = ()

    @classmethod
    def of(cls, key: str, device: int) -> ReplicaAt:
        return cls(f"{key}{AT}{int(device)}")

    @classmethod
    def parse(cls, text: object) -> ReplicaAt | None:
        """``text`` as a ReplicaAt, or None where it is not ``KEY@DEVICE`` (a device a
        number)."""
        if not isinstance(text, str):
            return None
        key, at, device = str.rpartition(text, AT)
        return cls(text) if at and key and device.isdigit() else None

    @property
    def key(self) -> ReplicaKey:
        return ReplicaKey(str.rpartition(self, AT)[0])

    @property
    def device(self) -> int:
        return int(str.rpartition(self, AT)[2])


STEP, CHUNK, RANK, TP_RANK = "s", "c", "r", "t"      # the fields of an op id, by their letter
JOIN = "join"                                         # the last part of a join's id


class OpId(str):
    """The id of one op call: its graph op, its step, and what tells the op's calls of a
    step apart: a chunk (``rollout/s0/c1``) or a data-parallel rank (``train/s0/r1``), a
    weight sync's role and the device loading it (``sync_actor/s0/export``,
    ``sync_actor~tp0-1/s0/load@2``), a further rank of a tensor-parallel block
    (``rollout/s0/c0/t1``, ``sync_actor/s0/send/t1``), and a join (``train/s0/r0/join``).
    Its text is the call's Dask key and what run records and traces write; its fields are
    read from it once.

        >>> i = OpId.of("sync_actor~tp0-1", 3, role="load", device=2)
        >>> i, i.op, i.step, i.role, i.device, i.chunk
        ('sync_actor~tp0-1/s3/load@2', 'sync_actor~tp0-1', 3, 'load', 2, None)
        >>> j = OpId.of("rollout", 0, chunk=1, tp_rank=1).joined
        >>> j, j.chunk, j.tp_rank, j.join, OpId(str(j)) == j
        ('rollout/s0/c1/t1/join', 1, 1, True, True)
    """

    __slots__ = ()

    @classmethod
    def of(cls, op: str, step: int, *, chunk: int | None = None, rank: int | None = None,
           role: str = "", device: int | None = None, tp_rank: int = 0) -> OpId:
        text = f"{op}/{STEP}{int(step)}"
        if chunk is not None:
            text += f"/{CHUNK}{int(chunk)}"
        elif rank is not None:
            text += f"/{RANK}{int(rank)}"
        if role:
            text += f"/{role}" + (f"{AT}{int(device)}" if device is not None else "")
        if tp_rank:
            text += f"/{TP_RANK}{int(tp_rank)}"
        return cls(text)

    @property
    def joined(self) -> OpId:
        """The id of the join a gang led by this call waits through."""
        return OpId(f"{self}/{JOIN}")

    @property
    def op(self) -> str:
        return _fields(self)[0]

    @property
    def step(self) -> int:
        return _fields(self)[1]

    @property
    def chunk(self) -> int | None:
        return _fields(self)[2]

    @property
    def rank(self) -> int | None:
        """The data-parallel rank of a train op's call (None: not one of several)."""
        return _fields(self)[3]

    @property
    def role(self) -> str:
        """A weight sync call's role (export, load, send, recv); "" for any other."""
        return _fields(self)[4]

    @property
    def device(self) -> int | None:
        """The device a load or receive runs on, which its id names."""
        return _fields(self)[5]

    @property
    def tp_rank(self) -> int:
        return _fields(self)[6]

    @property
    def join(self) -> bool:
        return _fields(self)[7]



@functools.lru_cache(maxsize=1 << 16)
def _fields(text: str) -> tuple:
    """(op, step, chunk, rank, role, device, tp rank, join) of an op id's text."""
    parts = str.split(text, "/")
    op, step = parts[0], parts[1]
    if step[:1] != STEP or not step[1:].isdigit():
        raise ValueError(f"an op id must be OP/sSTEP[/...], not {text!r}")
    chunk = rank = device = None
    role, tp, join = "", 0, False
    for part in parts[2:]:
        letter, rest = part[:1], part[1:]
        if part == JOIN:
            join = True
        elif letter == CHUNK and rest.isdigit():
            chunk = int(rest)
        elif letter == RANK and rest.isdigit():
            rank = int(rest)
        elif letter == TP_RANK and rest.isdigit():
            tp = int(rest)
        else:
            role, at, where = str.partition(part, AT)
            device = int(where) if at else None
    return op, int(step[1:]), chunk, rank, role, device, tp, join
