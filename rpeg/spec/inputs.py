"""The files a pipeline and a cluster were read from, and those a run of them reads: what
no command may write over (``rpeg.destinations``: ``compile -o`` onto the spec or its
dataset would replace the user's file with a plan).

    >>> files_read(load("pipelines/tiny_ppo.rpeg"))             # doctest: +SKIP
    (PosixPath('.../pipelines/tiny_ppo.rpeg'), PosixPath('.../pipelines/data/toy.jsonl'), ...)
"""

from __future__ import annotations

from pathlib import Path

from rpeg.errors import Span
from rpeg.spec.model import Cluster, Pipeline


def named_files(pipeline: Pipeline) -> list[tuple[str, str, Span | None]]:
    """(what, absolute path, where the spec names it) of every file a run of ``pipeline``
    reads: its datasets, the models' weights folders, the rewards' modules."""
    out: list[tuple[str, str, Span | None]] = []
    if pipeline.workload.dataset is not None:
        d = pipeline.workload.dataset
        out.append(("dataset", d.path, _at(d.span)))
    if pipeline.evaluation is not None:
        d = pipeline.evaluation.dataset
        out.append(("eval dataset", d.path, _at(d.span)))
    out += [(f"model '{m.name}' weights folder", m.weights, _at(m.span))
            for m in pipeline.models if m.weights]
    out += [(f"reward '{r.name}' module", r.source, _at(r.span))
            for r in pipeline.rewards if r.source]
    return out


def files_read(pipeline: Pipeline | None = None, cluster: Cluster | None = None
               ) -> tuple[Path, ...]:
    """Every file ``pipeline`` and ``cluster`` were read from or name: the spec and the
    bases it extends, :func:`named_files`, the tools' modules, the cluster file and its
    profile file."""
    paths: list[str] = []
    if pipeline is not None:
        paths += [pipeline.path, *pipeline.extends]
        paths += [p for _, p, _ in named_files(pipeline)]
        paths += [t.source for t in pipeline.tools if getattr(t, "source", "")]
    if cluster is not None:
        paths += [cluster.path, cluster.profile_file]
    return tuple(Path(p) for p in dict.fromkeys(paths) if p and not p.startswith("<"))


def _at(span: Span | None) -> Span | None:
    return span if span is not None and span.line else None


__all__ = ["files_read", "named_files"]
