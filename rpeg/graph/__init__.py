"""The RPEG IR: the step graph, its unrolling over steps, and its invariants.

    >>> from rpeg.graph import build, unroll, verify
    >>> g = verify(build(pipeline, share=True))      # doctest: +SKIP
    >>> u = unroll(g, steps=3, chunks={"rollout": 4})              # doctest: +SKIP
"""

from rpeg.graph.build import build
from rpeg.graph.ir import DataEdge, Graph, Op, VersionEdge
from rpeg.graph.unroll import Dep, DepKind, Instance, Unrolled, chunk_counts, unroll
from rpeg.graph.verify import verify, verify_unrolled
from rpeg.graph.work import Work, work_of

__all__ = [
    "build", "Graph", "Op", "DataEdge", "VersionEdge",
    "unroll", "Unrolled", "Instance", "Dep", "DepKind", "chunk_counts",
    "verify", "verify_unrolled", "Work", "work_of",
]
