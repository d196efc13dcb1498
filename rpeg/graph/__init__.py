"""The RPEG IR: the step graph, its unrolling over steps, and its invariants.

    >>> from rpeg.graph import Graph, unroll, verify
    >>> g = verify(Graph.from_pipeline(pipeline, share=True))      # doctest: +SKIP
    >>> u = unroll(g, steps=3, chunks={"rollout": 4})              # doctest: +SKIP
"""

from rpeg.graph.ir import DataEdge, Graph, Op, VersionEdge
from rpeg.graph.unroll import Dep, DepKind, Instance, Unrolled, chunk_counts, unroll
from rpeg.graph.verify import verify, verify_unrolled

__all__ = [
    "Graph", "Op", "DataEdge", "VersionEdge",
    "unroll", "Unrolled", "Instance", "Dep", "DepKind", "chunk_counts",
    "verify", "verify_unrolled",
]
