"""Replicas and weight transfers named: which copy of a model an op call reads, and the
roles of a weight sync's calls (shared by the calls' builder and its ordering passes).

    >>> base_of("actor~tp0-1"), engine_key("actor"), is_engine_key("actor~vllm")
    ('actor', 'actor~vllm', True)
    >>> key = ReplicaKey.of("actor+critic", "tp0-1")
    >>> key, key.backbone.members, key.variant, key.engine
    ('actor+critic~tp0-1', ('actor', 'critic'), 'tp0-1', False)
"""

from __future__ import annotations

import enum
from collections import defaultdict

import attrs

from rpeg.graph.ids import Backbone


class CallRole(enum.StrEnum):
    """The part a call plays besides running its op: one side of a weight sync, or a join.
    Its text is what ids, run records and traces write ("" for a call that only runs its
    op)."""

    NONE = ""
    EXPORT = "export"      # the trainer's sender hands the new weights to the copies beside it
    LOAD = "load"          # a copy on another device loads them
    SEND = "send"          # weight sync into a vLLM engine's copy, through collectives: the
    RECV = "recv"          # trainer's sender, and each engine hosting a copy
    JOIN = "join"          # runs no op: its inputs passed on as one value (rpeg.runtime.lowering.joins)

    @property
    def reads_at_reader(self) -> bool:
        """Runs on the reader's device (a load or an engine's receive), not the trainer's."""
        return self in (CallRole.LOAD, CallRole.RECV)


EXPORT, LOAD, SEND, RECV = CallRole.EXPORT, CallRole.LOAD, CallRole.SEND, CallRole.RECV
VARIANT = "~"          # "actor~tp0-1": a second copy of actor on a device, split another way
ENGINE = "vllm"        # "actor~vllm": the copy a vLLM engine serves (its own devices, or tp > 1)


class ReplicaKey(str):
    """Which copy of a backbone's weights an op call reads: the backbone's own name, or the
    name and a variant: ``actor~tp0-1`` (a second copy on a device, split another way),
    ``actor~vllm`` (the copy a vLLM engine serves alone). Its text is the key run records,
    checkpoints and the executors' replica tables use."""

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


def base_of(key: str | None) -> Backbone | None:
    """The backbone a replica key names (``actor~tp0-1`` -> ``actor``)."""
    return ReplicaKey(key).backbone if key else key


def engine_key(model: str) -> ReplicaKey:
    """The key of the copy of ``model`` a vLLM engine serves alone (``actor~vllm``)."""
    return ReplicaKey.of(model, ENGINE)


def variant_key(model: str, group: tuple[int, ...]) -> ReplicaKey:
    """The key of a second copy of ``model`` on a device, split over tp ``group``
    (``actor~tp0-1``; ``actor~whole``: unsplit)."""
    return ReplicaKey.of(model, "tp" + "-".join(map(str, group)) if group else "whole")


def is_engine_key(key: str | None) -> bool:
    return bool(key) and ReplicaKey(key).engine


def engine_hosts(calls) -> dict[str, tuple[int, ...]]:
    """Backbone -> the devices hosting a vLLM engine that serves its own copy of it."""
    out: dict[str, set[int]] = defaultdict(set)
    for c in calls:
        c = c if isinstance(c, dict) else attrs.asdict(c, recurse=False)
        if is_engine_key(c["model"]) and not c.get("role"):
            out[base_of(c["model"])].add(c["device"])
    return {k: tuple(sorted(v)) for k, v in out.items()}


def engine_blocks(plan, calls) -> dict[tuple[str, int], tuple[int, ...]]:
    """(engine copy key, host device) -> the devices its vLLM engine's workers span: the
    tensor-parallel block of its generate stage that starts at the host."""
    out = {}
    for c in calls:
        c = c if isinstance(c, dict) else attrs.asdict(c, recurse=False)
        if is_engine_key(c["model"]) and not c.get("role"):
            p = plan.placement(c["stages"][0])
            i = p.devices.index(c["device"])
            out[(c["model"], c["device"])] = tuple(p.devices[i:i + p.tp])
    return out
