"""Hardware profiles and clusters: the shipped ones, loading them, writing them.

    >>> gpu = builtin_profile("h100")
    >>> gpu.matmul_flops / 1e12, gpu.memory / 1e9
    (794.5, 80.0)
    >>> from rpeg.spec.model import Level
    >>> c = load_cluster("pipelines/clusters/gh200_64.rpeg")
    >>> c.num_gpus, c.gpu.name, c.link(Level.NODE).bandwidth / 1e9
    (64, 'gh200', 25.0)
    >>> print(profile_text(GpuProfile("cpu", memory=8e9)).splitlines()[1])
    profile cpu {

Profiles live in ``pipelines/clusters/profiles/*.rpeg`` (GPU figures from published
measurements, each file citing its source; ``local_cpu.rpeg`` written by ``rpeg
calibrate``). Loading is the language layer's (``rpeg.spec.load_cluster``).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import attrs

from rpeg.errors import CostError, did_you_mean
from rpeg.resources import clusters_dir, profiles_dir
from rpeg.spec.model import Cluster, GpuProfile

PROFILE_DIR = profiles_dir()
CLUSTER_DIR = clusters_dir()

def profile_fields() -> dict[str, str]:
    """Numeric GpuProfile fields and their unit dimension ("" for plain numbers)."""
    return {f.name: f.metadata["unit"] for f in attrs.fields(GpuProfile) if "unit" in f.metadata}


def load_profile(path: str | Path) -> GpuProfile:
    from rpeg.spec.cluster import load_profile as spec_load_profile
    return spec_load_profile(path)


def builtin_profile(name: str) -> GpuProfile:
    """A shipped profile by name (gh200, h100, h200, a100, local_cpu)."""
    path = PROFILE_DIR / f"{name}.rpeg"
    if not path.exists():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.rpeg"))
        raise CostError(f"gpu must be a shipped profile ({', '.join(names)}) or a file, "
                        f"not '{name}'", hint=did_you_mean(name, names))
    return load_profile(path)


def load_cluster(path: str | Path) -> Cluster:
    from rpeg.spec import load_cluster as spec_load_cluster
    return spec_load_cluster(path)


def builtin_cluster(name: str) -> Cluster:
    return load_cluster(CLUSTER_DIR / f"{name}.rpeg")


def cluster_of(gpu: str, gpus_per_node: int, nodes: int = 1, racks: int = 1) -> Cluster:
    """A cluster of shipped-profile GPUs with the links of the shipped cluster of that kind."""
    shipped = {"gh200": "gh200_64", "h100": "h100_64", "h200": "h100_64", "a100": "a100_64",
               "local_cpu": "local_cpu"}
    ref = builtin_cluster(shipped.get(gpu, "h100_64"))
    return Cluster(f"{gpu}_{gpus_per_node * nodes * racks}", "<python>", builtin_profile(gpu),
                   gpus_per_node, nodes, racks, ref.links)


def profile_text(p: GpuProfile, comment: str = "") -> str:
    """A profile as ``.rpeg`` text that ``load_profile`` reads back (to 4 significant digits)."""
    lines = [f"# {comment or 'rpeg hardware profile'} ({_dt.date.today().isoformat()})",
             f"profile {p.name} {{"]
    units = profile_fields()
    width = max(len(k) for k in units)
    measured = [f.name for f in attrs.fields(GpuProfile) if f.metadata.get("measured")]
    from rpeg.spec.cluster import CPU_TERMS  # a GPU's engines run on their own terms
    skipped = set(CPU_TERMS) if p.async_launch else set()
    for key, dim in units.items():
        if key not in measured and key not in skipped:
            lines.append(f"    {key:<{width}} = {_with_unit(getattr(p, key), dim)}")
    if p.source:
        lines.append(f'    {"source":<{width}} = "{_escape(p.source)}"')
    defaults = GpuProfile(p.name)
    for key in measured:      # what was measured: a field at its default says nothing
        if getattr(p, key) != getattr(defaults, key):
            lines.append(f"    {key:<{width}} = {_with_unit(getattr(p, key), units[key])}")
    lines.append("}")
    from rpeg.spec.printer import format_text  # the canonical form `rpeg fmt --check` expects
    return format_text("\n".join(lines) + "\n")


def _with_unit(x: float, dim: str) -> str:
    """``x`` with the largest unit that keeps it at or above 1 (4 significant digits)."""
    scales = {"bytes": (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)),
              "bytes/s": (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("B/s", 1.0)),
              "flops": (("TFLOPS", 1e12), ("GFLOPS", 1e9), ("MFLOPS", 1e6), ("FLOPS", 1.0)),
              "s": (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))}
    if dim == "":
        return _num(x)
    if dim == "fraction":
        return f"{_num(100 * x)}%"
    if x == 0:
        return "0 " + next(u for u, f in scales[dim] if f == 1.0)
    for unit, f in scales[dim]:
        if abs(x) >= f:
            return f"{_num(x / f)} {unit}"
    return f"0 {scales[dim][-1][0]}"


def _num(x: float) -> str:
    return f"{float(x):.4g}"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
