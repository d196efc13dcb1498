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

from rpeg.graph.ids import (  # noqa: F401 — the replica keys are also this module's
    ENGINE,
    VARIANT,
    Backbone,
    ReplicaKey,
    engine_key,
    variant_key,
)


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


def base_of(key: str | None) -> Backbone | None:
    """The backbone a replica key names (``actor~tp0-1`` -> ``actor``)."""
    return ReplicaKey(key).backbone if key else key


def is_engine_key(key: str | None) -> bool:
    return bool(key) and ReplicaKey(key).engine
