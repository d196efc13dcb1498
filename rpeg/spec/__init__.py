"""The .rpeg language: parse, check, resolve ``extend``, and give meaning.

    >>> from rpeg.spec import load, load_cluster
    >>> pipeline = load("pipelines/ppo_llama8b.rpeg")                  # doctest: +SKIP
    >>> cluster = load_cluster("pipelines/clusters/gh200_64.rpeg")     # doctest: +SKIP
    >>> cluster.num_gpus                                               # doctest: +SKIP
    64
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rpeg.errors import Span, SpecError
from rpeg.spec.cluster import lower_cluster, lower_profile
from rpeg.spec.lower import lower_pipeline
from rpeg.spec.model import (
    Cluster,
    Engine,
    GpuProfile,
    Head,
    LengthDist,
    LengthKind,
    Level,
    Link,
    Model,
    OpKind,
    Optimizer,
    Pin,
    Pipeline,
    Reward,
    Stage,
    Workload,
)
from rpeg.spec.parser import gc_paused, parse_file, parse_text
from rpeg.spec.presets import PRESETS, ModelDims
from rpeg.spec.resolve import FileKind, file_kind
from rpeg.spec.values import Fn

__all__ = [
    # loading
    "load", "load_cluster", "check_file", "Checked", "parse_file", "parse_text", "FileKind",
    # values
    "Pipeline", "Workload", "LengthDist", "LengthKind", "Model", "Optimizer", "Reward", "Stage",
    "Pin",
    "OpKind", "Head", "Engine", "Fn", "Cluster", "GpuProfile", "Link", "Level",
    "ModelDims", "PRESETS",
]


@attrs.frozen
class Checked:
    kind: FileKind
    value: Pipeline | Cluster | GpuProfile
    warnings: tuple[SpecError, ...] = ()


def check_file(path: str | Path, overrides: tuple = ()) -> Checked:
    """Parse and check any .rpeg file; raises SpecError on the first problem. ``overrides``
    (``rpeg.spec.overrides.parse_overrides``) change a pipeline before it is checked."""
    with gc_paused():               # millions of small objects, no cycles (rpeg.spec.parser)
        f = parse_file(path)
        kind = file_kind(f)
        if kind is FileKind.PIPELINE:
            pipeline, warnings = lower_pipeline(f, overrides)
            return Checked(kind, pipeline, tuple(warnings))
        if kind is FileKind.CLUSTER:
            return Checked(kind, lower_cluster(f))
        return Checked(kind, lower_profile(f))


def load(path: str | Path, overrides: tuple = ()) -> Pipeline:
    """A checked pipeline (``extend`` resolved, ``overrides`` applied); SpecError if the file
    is not one."""
    checked = check_file(path, overrides)
    if checked.kind is not FileKind.PIPELINE:
        raise SpecError(f"'{path}' describes a {checked.kind.value}, not a pipeline",
                        Span(str(path), 1, 1))
    return checked.value


def load_cluster(path: str | Path) -> Cluster:
    """A checked cluster; SpecError if the file is not one."""
    checked = check_file(path)
    if checked.kind is not FileKind.CLUSTER:
        raise SpecError(f"'{path}' describes a {checked.kind.value}, not a cluster",
                        Span(str(path), 1, 1),
                        hint="a cluster file holds 'cluster NAME { gpu = ...; gpus_per_node "
                             "= ... }' (pipelines/clusters/ has examples)")
    return checked.value
