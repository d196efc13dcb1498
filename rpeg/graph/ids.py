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
