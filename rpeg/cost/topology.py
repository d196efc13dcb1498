"""Cluster topology and collective communication costs (alpha-beta per level).

    >>> from rpeg.cost.profiles import cluster_of
    >>> topo = Topology.from_cluster(cluster_of("h100", gpus_per_node=8, nodes=2))
    >>> topo.level_of((0, 1, 2, 3)), topo.level_of((0, 8))
    (<Level.GPU: 0>, <Level.NODE: 1>)
    >>> t = collective_time(Collective.ALL_REDUCE, 1e9, tuple(range(8)), topo)
    >>> round(t * 1e3, 2)          # ring: 2 (n-1)/n * 1 GB / 450 GB/s + 14 * 1 us
    3.9

A cluster is a tree: GPUs in a node, nodes in a rack, racks in the system. A set
of devices spans the slowest level that joins any two of them. A collective over
a set is costed as a flat ring at that level, or hierarchically (reduce-scatter
inside each lower group, the collective across groups on a 1/k share, all-gather
back), whichever is cheaper. Bandwidths are per GPU, one direction.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence

import attrs

from rpeg.errors import CostError
from rpeg.spec.model import Cluster, Level, Link


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    P2P = "p2p"
    ALL_TO_ALL = "all_to_all"


@attrs.frozen(cache_hash=True)      # a cache key of the cost functions: hash it once
class Topology:
    """Where each device sits (node, rack) and the link of each level."""

    gpus_per_node: int
    nodes_per_rack: int
    racks: int
    links: tuple[Link, ...]

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> Topology:
        """The cluster's topology, built once per cluster value (every cost call asks)."""
        held = _BUILT.get(id(cluster))
        if held is not None and held[0] is cluster:
            return held[1]
        topo = cls._build(cluster)
        if len(_BUILT) >= 64:
            _BUILT.clear()
        _BUILT[id(cluster)] = (cluster, topo)    # the cluster held: its id is not reused
        return topo

    @classmethod
    def _build(cls, cluster: Cluster) -> Topology:
        levels = {link.level for link in cluster.links}
        needed = {Level.GPU} | ({Level.NODE} if cluster.num_nodes > 1 else set()) \
            | ({Level.RACK} if cluster.racks > 1 else set())
        missing = sorted(needed - levels)
        if missing:
            names = ", ".join(lv.name.lower() for lv in missing)
            raise CostError(f"cluster '{cluster.name}' must describe a link for every level it "
                            f"has, not lack {names}", cluster.span,
                            hint=f"add `link {missing[0].name.lower()} {{ bandwidth = ...; "
                                 f"latency = ... }}`")
        return cls(cluster.gpus_per_node, cluster.nodes_per_rack, cluster.racks,
                   tuple(sorted(cluster.links, key=lambda link: link.level)))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes_per_rack * self.racks

    def node_of(self, device: int) -> int:
        return device // self.gpus_per_node

    def rack_of(self, device: int) -> int:
        return device // (self.gpus_per_node * self.nodes_per_rack)

    def level_of(self, devices: Sequence[int]) -> Level:
        """The slowest level joining any two of ``devices`` (GPU for one device)."""
        if not devices:
            return Level.GPU
        lo, hi = min(devices), max(devices)      # node and rack grow with the device index
        if self.rack_of(lo) != self.rack_of(hi):
            return Level.RACK
        if self.node_of(lo) != self.node_of(hi):
            return Level.NODE
        return Level.GPU

    def link(self, level: Level) -> Link:
        for link in self.links:
            if link.level is level:
                return link
        # A level the cluster does not have (one node): fall back to the nearest faster one.
        return self.link(Level(level - 1)) if level > Level.GPU else self.links[0]

    def groups(self, devices: Sequence[int], level: Level) -> list[tuple[int, ...]]:
        """``devices`` split into the units joined by ``level`` (nodes for NODE, racks for RACK)."""
        key = self.node_of if level is Level.NODE else self.rack_of
        out: dict[int, list[int]] = {}
        for d in devices:
            out.setdefault(key(d), []).append(d)
        return [tuple(g) for g in out.values()]


_BUILT: dict[int, tuple[Cluster, Topology]] = {}     # id(cluster) -> (cluster, its topology)


def _flat(kind: Collective, nbytes: float, n: int, link: Link) -> float:
    """One collective over ``n`` peers on one link (ring algorithms; tree for broadcast)."""
    a, bw = link.latency, link.bandwidth
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / bw
    if kind in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER):
        return (n - 1) * a + (n - 1) / n * nbytes / bw
    if kind is Collective.BROADCAST:
        return math.ceil(math.log2(n)) * a + nbytes / bw      # pipelined tree
    if kind is Collective.ALL_TO_ALL:
        return (n - 1) * a + (n - 1) / n * nbytes / bw
    return a + nbytes / bw                                      # P2P


def collective_time(kind: Collective, nbytes: float, devices: Sequence[int],
                    topo: Topology) -> float:
    """Seconds for one collective of ``nbytes`` (the full buffer, per device) over ``devices``.

    For REDUCE_SCATTER and ALL_GATHER, ``nbytes`` is the full (unsharded) buffer.
    For ALL_TO_ALL, ``nbytes`` is what each device sends in all (a 1/n share to each peer):
    across a slower level, the shares to peers in the device's own unit go over the fast
    link while the rest cross the slow one, at the same time.
    For P2P, ``devices`` are the two ends.
    """
    return _collective_time(kind, float(nbytes), tuple(devices), topo)


@functools.lru_cache(maxsize=1 << 16)      # pure; the planner prices the same groups often
def _collective_time(kind: Collective, nbytes: float, devices: tuple[int, ...],
                     topo: Topology) -> float:
    devices = tuple(dict.fromkeys(devices))
    n = len(devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    level = topo.level_of(devices)
    flat = _flat(kind, nbytes, n, topo.link(level))
    if level is Level.GPU or kind is Collective.P2P:
        return flat
    if kind is Collective.ALL_TO_ALL:
        near = min(len(g) for g in topo.groups(devices, level))
        inner = topo.link(Level(level - 1))
        slow = topo.link(level)
        return max((near - 1) * inner.latency + (near - 1) / n * nbytes / inner.bandwidth,
                   (n - near) * slow.latency + (n - near) / n * nbytes / slow.bandwidth)
    return min(flat, _hierarchical(kind, nbytes, devices, level, topo))


def _hierarchical(kind: Collective, nbytes: float, devices: tuple[int, ...], level: Level,
                  topo: Topology) -> float:
    groups = topo.groups(devices, level)
    k = min(len(g) for g in groups)          # the smallest group bounds the split
    if len(groups) <= 1 or k <= 1 or any(len(g) != len(groups[0]) for g in groups):
        return math.inf
    inner = groups[0]
    leaders = tuple(g[0] for g in groups)
    share = nbytes / k
    if kind is Collective.ALL_REDUCE:
        return (collective_time(Collective.REDUCE_SCATTER, nbytes, inner, topo)
                + collective_time(Collective.ALL_REDUCE, share, leaders, topo)
                + collective_time(Collective.ALL_GATHER, nbytes, inner, topo))
    if kind is Collective.REDUCE_SCATTER:
        return (collective_time(Collective.REDUCE_SCATTER, nbytes, inner, topo)
                + collective_time(Collective.REDUCE_SCATTER, share, leaders, topo))
    if kind is Collective.ALL_GATHER:
        return (collective_time(Collective.ALL_GATHER, share, leaders, topo)
                + collective_time(Collective.ALL_GATHER, nbytes, inner, topo))
    # BROADCAST: one copy across groups (split k ways over the group's links), then inside.
    return (collective_time(Collective.BROADCAST, share, leaders, topo)
            + collective_time(Collective.ALL_GATHER, nbytes, inner, topo))
