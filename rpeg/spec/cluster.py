"""Clusters and hardware profiles in the .rpeg language: ``ast.File`` -> ``Cluster``.

    cluster gh200_64 {
        gpu            = "profiles/gh200.rpeg"   # a profile file, a builtin name, or inline:
        gpus_per_node  = 4                       #   gpu gh200 { memory = 96 GB; ... }
        nodes_per_rack = 8
        racks          = 2
        link gpu  { bandwidth = 450 GB/s; latency = 1 us }
        link node { bandwidth = 25 GB/s;  latency = 5 us }
        link rack { bandwidth = 25 GB/s;  latency = 10 us }
        tool_cores     = 64                      # host cores per node for tool calls
    }                                            #   (default: one per GPU)

A profile file holds ``profile NAME { key = value ... }``; its keys are the fields of
``GpuProfile``, each with the unit its metadata names, and any other key is an error.
``reserve = 10%`` (in a profile, or in a cluster over its profile's) is the share of each
device's memory that plans leave free; ``gpu h100 { memory = 72 GB }`` in a cluster is the
shipped profile with the keys given changed.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.resources import profiles_dir
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.keys import CLUSTER, LINK, MAX_GPU, PROFILE_REQUIRED, profile_section, read
from rpeg.spec.model import Cluster, GpuProfile, Level, Link
from rpeg.spec.parser import parse_file
from rpeg.spec.paths import resolve_written, written_folder
from rpeg.spec.resolve import FileKind, file_kind

CLUSTER_KEYS = CLUSTER.keys
LINK_KEYS = LINK.keys
MAX_GPUS = MAX_GPU
PROFILE_DIRS = (profiles_dir(),)


def lower_profile_block(name: ast.Ident, block: ast.Block,
                        base: GpuProfile | None = None) -> GpuProfile:
    """A profile from its block's keys; ``base``: the profile whose figures the keys
    change (a shipped one named in a cluster: ``gpu h100 { reserve = 20% }``)."""
    section = profile_section()
    fields = section.keys
    values: dict[str, object] = {}
    seen: dict[str, Span] = {}
    for e in block.entries:
        if isinstance(e, ast.Section):
            hint = ("write its keys in the profile itself, each with its unit"
                    if e.kind.value == "extra" else None)
            raise SpecError(f"a profile has no section '{e.kind.value}'", e.kind.span, hint=hint)
        key = e.key
        if key.value not in fields:
            raise V.unknown_key(key, tuple(fields), f"profile '{name.value}'")
        if key.value in seen:
            raise V.duplicate("key", key.value, key.span, seen[key.value])
        seen[key.value] = key.span
        values[key.value] = read(e, section.param(key.value))
    if base is not None:
        values = {**{k: getattr(base, k) for k in fields}, **values}
    for key, what, example in PROFILE_REQUIRED:      # what every price divides by
        if values.get(key, 0) > 0:
            continue
        if key in seen:
            raise SpecError(f"profile '{name.value}': {key} must be more than 0 ({what})",
                            seen[key], hint=f"e.g. {key} = {example}")
        raise SpecError(f"profile '{name.value}' must give {key} ({what})", name.span,
                        hint=f"add '{key} = {example}', or start from a shipped profile: "
                             f"gpu h100 {{ ... }}")
    launch = values.get("async_launch", GpuProfile.__attrs_attrs__.async_launch.default)
    written = next((k for k in CPU_TERMS if k in seen), None)
    if launch and written is not None:
        raise SpecError(f"profile '{name.value}': {written} must be left out where "
                        "async_launch = 1 (a GPU): a GPU's engines run with the cost model's "
                        "host terms, the same on every GPU (rpeg/cost/engines.py), and this "
                        "figure would change nothing", seen[written],
                        hint=f"drop {written}; it prices a device whose host time adds to "
                             "its work (async_launch = 0, a CPU rpeg calibrate measured)")
    return GpuProfile(name=name.value, **values)


# A profile's figures of the host time an engine adds to its work, read where that time
# adds (async_launch = 0: a CPU rpeg calibrate measured): on a GPU the engines' own terms
# (rpeg.cost.engines.engine_terms) stand in their place.
CPU_TERMS = ("layer_overhead", "decode_overhead", "vllm_layer_overhead",
             "vllm_decode_overhead", "vllm_work_scale", "grads_freed")



def lower_profile(f: ast.File) -> GpuProfile:
    item = next(i for i in f.items if isinstance(i, ast.ProfileDecl))
    return lower_profile_block(item.name, item.block)


def load_profile(path: str | Path, span: Span | None = None) -> GpuProfile:
    f = parse_file(path)
    if file_kind(f) is not FileKind.PROFILE:
        raise SpecError(f"'{path}' must hold a profile, not a {file_kind(f).value}",
                        span or Span(str(path), 1, 1))
    return lower_profile(f)


def builtin_profiles() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in PROFILE_DIRS:
        if d.is_dir():
            out.update({p.stem: p for p in sorted(d.glob("*.rpeg"))})
    return out


def lower_cluster(f: ast.File) -> Cluster:
    item = next(i for i in f.items if isinstance(i, ast.ClusterDecl))
    gpu: GpuProfile | None = None
    ints: dict[str, int] = {}
    links: dict[Level, Link] = {}
    seen: dict[str, Span] = {}
    reserve: float | None = None
    profile_file = ""
    for e in item.block.entries:
        if isinstance(e, ast.Section):
            if e.kind.value == "gpu" and e.name is not None:
                # a shipped profile's name: its figures, the block's keys changed
                shipped = builtin_profiles().get(e.name.value)
                gpu = lower_profile_block(e.name, e.block, None if shipped is None
                                          else load_profile(shipped, e.name.span))
                profile_file = str(shipped or "")
                continue
            if e.kind.value != "link":
                raise V.unknown_key(e.kind, CLUSTER_KEYS, f"cluster '{item.name.value}'")
            link = _link(e)
            if link.level in links:
                raise V.duplicate("link", e.name.value, e.span, links[link.level].span)
            links[link.level] = link
            continue
        key = e.key
        if key.value not in CLUSTER_KEYS or key.value == "link":
            raise V.unknown_key(key, CLUSTER_KEYS, f"cluster '{item.name.value}'")
        if key.value in seen:
            raise V.duplicate("key", key.value, key.span, seen[key.value])
        seen[key.value] = key.span
        if key.value == "gpu":
            if not isinstance(e, ast.Assign):
                raise SpecError(f"{key.value} must be set with '{key.value} = VALUE'", e.span)
            gpu, profile_file = _gpu(e.value)
        elif key.value == "reserve":
            reserve = read(e, CLUSTER.param(key.value))
        else:
            ints[key.value] = read(e, CLUSTER.param(key.value))
    if gpu is None:
        raise SpecError(f"cluster '{item.name.value}' must say which gpu it has", item.name.span,
                        hint='add gpu = "profiles/NAME.rpeg" or gpu = h100')
    if reserve is not None:            # the cluster's own reserve, over its profile's
        gpu = attrs.evolve(gpu, reserve=reserve)
    if "gpus_per_node" not in ints:
        raise SpecError(f"cluster '{item.name.value}' must set gpus_per_node", item.name.span)
    cluster = Cluster(name=item.name.value, path=f.path, gpu=gpu,
                      gpus_per_node=ints["gpus_per_node"],
                      nodes_per_rack=ints.get("nodes_per_rack", 1), racks=ints.get("racks", 1),
                      links=tuple(links[k] for k in sorted(links)), span=item.span,
                      tool_cores=ints.get("tool_cores", 0), profile_file=profile_file)
    if cluster.num_gpus > MAX_GPUS:
        raise SpecError(f"cluster has {cluster.num_gpus:,} GPUs; rpeg plans at most {MAX_GPUS:,}",
                        item.span)
    needed = [Level.GPU] if cluster.gpus_per_node > 1 else []
    if cluster.nodes_per_rack > 1:
        needed.append(Level.NODE)
    if cluster.racks > 1:
        needed.append(Level.RACK)
    for level in needed:
        if level not in links:
            raise SpecError(f"cluster '{item.name.value}' needs a 'link {level.name.lower()}' "
                            "section (bandwidth and latency)", item.name.span,
                            hint=f"add: link {level.name.lower()} {{ bandwidth = 25 GB/s; "
                                 "latency = 5 us }")
    return cluster


def _link(e: ast.Section) -> Link:
    levels = {lv.name.lower(): lv for lv in Level}
    if e.name is None or e.name.value not in levels:
        got = e.name.value if e.name else "(none)"
        raise SpecError(f"link level must be one of {', '.join(levels)}, not {got}",
                        (e.name or e.kind).span, hint=did_you_mean(got, levels))
    vals: dict[str, float] = {}
    for x in e.block.entries:
        if not isinstance(x, ast.Assign) or x.key.value not in LINK_KEYS:
            key = x.kind if isinstance(x, ast.Section) else x.key
            raise V.unknown_key(key, LINK_KEYS, f"link {e.name.value}")
        vals[x.key.value] = read(x, LINK.param(x.key.value))
    for k in LINK_KEYS:
        if k not in vals:
            raise SpecError(f"link {e.name.value} must set {k}", e.span)
    if vals["bandwidth"] <= 0:
        raise SpecError("bandwidth must be positive", e.span)
    return Link(levels[e.name.value], vals["bandwidth"], vals["latency"], e.span)


def _gpu(v: ast.Value) -> tuple[GpuProfile, str]:
    """(the profile ``gpu = ...`` names, the file it was read from)."""
    if isinstance(v, ast.Str):
        p = resolve_written(v.value, v.span)
        if not p.is_file():
            raise SpecError(f"gpu profile file '{v.value}' not found", v.span,
                            hint="paths are relative to the cluster file's folder "
                                 f"({written_folder(v.span)})")
        return load_profile(p, v.span), str(p)
    if isinstance(v, ast.Ident):
        known = builtin_profiles()
        if v.value not in known:
            raise SpecError(f"unknown gpu profile '{v.value}'", v.span,
                            hint=did_you_mean(v.value, known) or
                            "builtin profiles: " + ", ".join(known))
        return load_profile(known[v.value], v.span), str(known[v.value])
    raise SpecError(f"gpu must be a profile name or a profile file path, not {V.kind_of(v)}",
                    v.span)
