"""The execution plan: one immutable value for searched, baseline and hand-written plans.

    >>> plan = Plan(pipeline="tiny", cluster="local_cpu", num_devices=2,
    ...             placements=(StagePlacement.of("rollout", (0, 1), dp=2),))
    >>> Plan.from_json(plan.to_json()) == plan
    True
    >>> print(plan)                                        # doctest: +NORMALIZE_WHITESPACE
    plan tiny on local_cpu (2 devices, strategy manual, seed 0)
      stage    devices  dp tp pp  mb  zero  chunks  engine
      rollout  0-1       2  1  1   1     0       1  torch

A plan says, per stage, which devices run it and how (DP x TP x PP, micro-batches,
ZeRO level, engine, chunks); per model, where its weights live between stages; the
structural choices (staleness, sharing, fusion); what the cost model
predicted for it; and, for a compiled plan, the search options that made it
(``search``: seed, budget, limits, and whether the time cap stopped it). It round-trips through JSON with a schema version; reading a
damaged or foreign file raises :class:`PlanError` naming the file and the problem.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import operator
import re
import stat
from pathlib import Path

import attrs

from rpeg.cost.memory import MemoryCost
from rpeg.errors import PlanError, Span
from rpeg.graph.layout import LAYOUT, Layout, changed, layout_of
from rpeg.plan.options import Method, SearchOptions, SearchRecord, Start
from rpeg.plan.space import Limits
from rpeg.spec.model import Engine, Zero

SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 64 * 1024 * 1024      # checked before reading: a plan is kilobytes
MAX_PLAN_DEVICES = 1 << 20             # as for clusters (rpeg.spec.cluster.MAX_GPUS)
MAX_CARRY = 64                         # steps a partial rollout may span, beyond its own
MAX_STALENESS = 1000                   # versions a reader may lag (a spec's bound is far less)


class Strategy(enum.Enum):
    SEARCH = "search"
    COLOCATED = "colocated"
    SPLIT = "split"
    REALLOC = "realloc"
    MANUAL = "manual"
    PINNED = "pinned"             # the spec's pinned layouts priced as they are (no search)


def _reads(path: str) -> property:
    """A read-only view of one of the layout's fields, by the placement's flat name."""
    get = operator.attrgetter(path)
    return property(lambda self: get(self))


@attrs.frozen(cache_hash=True)       # a key of the evaluator's caches: hashed once
class StagePlacement:
    """Where a stage runs and how: its devices, the :class:`~rpeg.graph.layout.Layout` the
    cost model prices and the runtime lays its calls out by, its engine, and the plan's own
    choices for it (a generate stage's chunks and carry). Read flat (``p.dp``, ``p.zero``,
    ``p.max_num_seqs``) or whole (``p.layout``); made flat with :meth:`of` and changed with
    :meth:`changed`."""

    stage: str
    devices: tuple[int, ...]          # global device indices, contiguous blocks
    layout: Layout = LAYOUT
    engine: Engine = Engine.TORCH
    chunks: int = 1                   # generation streams finished responses in this many chunks
    carry: int = 0                    # generate: each response spans up to carry + 1 steps (a step
                                      # also advances the next carry steps' responses; partial
                                      # rollouts); 0: whole responses in their own step

    @classmethod
    def of(cls, stage: str, devices: tuple[int, ...], *, engine: Engine = Engine.TORCH,
           chunks: int = 1, carry: int = 0, **layout) -> StagePlacement:
        """A placement from flat fields (as plan files write them): the layout's own, and
        a generate stage's engine settings (``max_num_seqs``, ``kv_fraction``,
        ``cuda_graph``)."""
        return cls(stage, devices, layout_of(**layout), engine, chunks, carry)

    def changed(self, **changes) -> StagePlacement:
        """This placement with flat ``changes``: its own fields or its layout's."""
        own = {k: changes.pop(k) for k in _OWN if k in changes}
        if changes:
            own["layout"] = changed(self.layout, **changes)
        return attrs.evolve(self, **own) if own else self

    def plain(self) -> dict:
        """Its fields flat, in the order plan files write them."""
        return {name: getattr(self, name) for name, _ in PLACEMENT_FIELDS}

    dp = _reads("layout.dp")
    tp = _reads("layout.tp")
    pp = _reads("layout.pp")
    cp = _reads("layout.cp")                    # context (sequence) parallel degree
    ep = _reads("layout.ep")                    # expert parallel degree (inside dp x cp x tp)
    microbatches = _reads("layout.microbatches")
    recompute = _reads("layout.recompute")
    zero = _reads("layout.zero")                # a train stage's ZeRO level
    offload = _reads("layout.offload")          # train: optimizer state in host memory
    packing = _reads("layout.packing")          # forward / train: sequences packed, no padding
    param_offload = _reads("layout.param_offload")   # weights in host memory between passes
    # generate: sequences one replica decodes at once (0: the stage's max_num_seqs, else as
    # many as memory holds); the share of a device the engine takes (0: the stage's
    # kv_fraction, else what is free); decode steps replayed from CUDA graphs
    max_num_seqs = _reads("layout.decoding.max_num_seqs")
    kv_fraction = _reads("layout.decoding.kv_fraction")
    cuda_graph = _reads("layout.decoding.cuda_graph")


_OWN = ("stage", "devices", "layout", "engine", "chunks", "carry")
# a placement's fields as plan files write them (flat), with the type each is read as
PLACEMENT_FIELDS = (("stage", "str"), ("devices", "tuple[int, ...]"), ("dp", "int"),
                    ("tp", "int"), ("pp", "int"), ("microbatches", "int"), ("chunks", "int"),
                    ("engine", "Engine"), ("recompute", "bool"), ("zero", "Zero"),
                    ("offload", "bool"), ("carry", "int"), ("cp", "int"), ("ep", "int"),
                    ("packing", "bool"), ("param_offload", "bool"), ("max_num_seqs", "int"),
                    ("kv_fraction", "float"), ("cuda_graph", "bool"))


@attrs.frozen
class OpUse:
    """What one op of a step computes and moves, and how much of the hardware it uses."""

    stage: str                  # the op (a fused op's stages joined by +)
    devices: int                # devices it runs on
    flops: float                # FLOPs a step, over its devices
    bytes: float                # bytes moved through device memory a step, over its devices
    time_s: float               # predicted seconds a step
    mfu: float                  # achieved fraction of the devices' peak compute
    mbu: float                  # achieved fraction of their memory bandwidth


@attrs.frozen
class MemoryUse(MemoryCost):
    """Predicted peak bytes per device of a group of devices alike, by kind."""

    devices: tuple[int, ...] = ()
    op: str = ""                # the op whose transient need sets the peak


@attrs.frozen
class Predicted:
    step_time_s: float
    peak_memory: tuple[float, ...] = ()    # bytes, per device index
    busy: tuple[float, ...] = ()           # fraction of the step each device computes
    tokens_per_s: float = 0.0
    op_times: tuple[tuple[str, float], ...] = ()   # op -> predicted seconds per step
    memory_capacity: float = 0.0           # bytes per device
    control_s: float = 0.0                 # of the step: the control plane on the devices' cores
    tasks_per_step: int = 0                # Dask tasks a step dispatches (where control_s > 0)
    ops: tuple[OpUse, ...] = ()            # per op: FLOPs, bytes, time, MFU, MBU
    memory: tuple[MemoryUse, ...] = ()     # per group of devices alike: the peak by kind
    memory_reserve: float = 0.0            # bytes per device kept free (of memory_capacity)


@attrs.frozen(cache_hash=True)
class Plan:
    pipeline: str
    cluster: str
    num_devices: int
    placements: tuple[StagePlacement, ...]
    model_homes: tuple[tuple[str, tuple[int, ...]], ...] = ()   # model -> devices holding its weights
    staleness: tuple[tuple[str, int], ...] = ()                 # stage -> chosen staleness (<= the
                                                  # spec's bound); unlisted: 0 (plan.staleness)
    shared: tuple[tuple[str, ...], ...] = ()                    # models merged into one backbone
    fusion: tuple[tuple[str, ...], ...] = ()                    # stages fused into one op
    predicted: Predicted | None = None
    strategy: Strategy = Strategy.MANUAL
    seed: int = 0
    spec_hash: str = ""
    rpeg_version: str = ""
    spec_path: str = ""               # where the spec and cluster were read (rpeg simulate)
    cluster_path: str = ""
    search: SearchRecord | None = None    # how it was compiled: `rpeg compile PLAN` remakes it
    schema_version: int = SCHEMA_VERSION

    @functools.cached_property
    def _by_stage(self) -> dict[str, StagePlacement]:
        """Stage -> its placement, derived once (not part of the value)."""
        return {p.stage: p for p in self.placements}

    def has_placement(self, stage: str) -> bool:
        return stage in self._by_stage

    def placement(self, stage: str) -> StagePlacement:
        p = self._by_stage.get(stage)
        if p is None:
            raise PlanError(f"plan for '{self.pipeline}' must place stage '{stage}', not "
                            f"omit it")
        return p

    def staleness_of(self, stage: str) -> int:
        return dict(self.staleness).get(stage, 0)

    def home(self, model: str) -> tuple[int, ...]:
        return dict(self.model_homes).get(model, ())

    # --- JSON ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, path: str = "<plan>") -> Plan:
        """Parse a plan; anything wrong with it is a PlanError naming ``path``."""
        return cls.from_dict(read_json_text(text, path, "plan file"), path)

    @classmethod
    def from_dict(cls, data: object, path: str = "<plan>") -> Plan:
        where = Span(path, 0, 0)
        if not isinstance(data, dict):
            kind = {list: "a list", str: "a string", bool: "a truth value", int: "a number",
                    float: "a number", type(None): "null"}.get(type(data), type(data).__name__)
            raise PlanError(f"plan must be a JSON object, not {kind}", where,
                            hint="write plans with `rpeg compile -o plan.json`")
        version = data.get("schema_version")
        if version is None:
            raise PlanError(f"plan must say its schema_version ({SCHEMA_VERSION}), and this "
                            "JSON object has none: it is no plan rpeg wrote", where,
                            hint="write plans with `rpeg compile -o plan.json`")
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan schema_version must be {SCHEMA_VERSION}, not {version!r}",
                            where, hint="recompile the spec with this rpeg "
                                        "(`rpeg compile FILE.rpeg --cluster CLUSTER.rpeg`)")
        try:
            plan = _from_plain(cls, data, "")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan must hold well-formed fields, not: {_describe(e)}",
                            where, hint="recompile, or compare with a plan rpeg wrote") from None
        problem = plan.inconsistency()
        if problem:
            raise PlanError(problem, where, hint="recompile, or fix the placement by hand")
        return plan

    def inconsistency(self) -> str | None:
        """What makes this plan impossible to execute as written, or None (the checks that
        need no spec; :mod:`rpeg.plan.validate` resolves its names against one)."""
        n = self.num_devices
        if not 1 <= n <= MAX_PLAN_DEVICES:
            return f"num_devices must be 1..{MAX_PLAN_DEVICES:,}, not {n:,}"
        seen = set()
        for i, p in enumerate(self.placements):
            where = f"placements[{i}] (stage '{p.stage}')"
            if p.stage in seen:
                return f"stage '{p.stage}' must be placed once, not twice"
            seen.add(p.stage)
            if min(p.dp, p.tp, p.pp, p.microbatches, p.chunks, p.cp, p.ep) < 1:
                return f"stage '{p.stage}' degrees must be at least 1"
            if not 0 <= p.carry <= MAX_CARRY:
                return f"stage '{p.stage}' carry must be 0..{MAX_CARRY} steps, not {p.carry}"
            if not 0 <= p.max_num_seqs <= MAX_PLAN_DEVICES:
                return f"{where} max_num_seqs must be 0..{MAX_PLAN_DEVICES:,}, not {p.max_num_seqs}"
            if not 0 <= p.kv_fraction <= 1:
                return f"{where} kv_fraction must be a fraction 0..1, not {p.kv_fraction}"
            if max(p.microbatches, p.chunks, p.dp, p.tp, p.pp, p.cp, p.ep) > MAX_PLAN_DEVICES:
                return f"stage '{p.stage}' micro-batches and chunks must be at most " \
                       f"{MAX_PLAN_DEVICES:,}"
            if len(p.devices) != p.dp * p.tp * p.pp * p.cp:
                degrees = "dp x tp x pp" + (" x cp" if p.cp > 1 else "")
                return (f"stage '{p.stage}' must run on {degrees} = "
                        f"{p.dp * p.tp * p.pp * p.cp} devices, not {len(p.devices)}")
            bad = [d for d in p.devices if not 0 <= d < n]
            if bad:
                return (f"stage '{p.stage}' devices must lie in 0..{n - 1}, "
                        f"not include {bad[0]}")
            if len(set(p.devices)) != len(p.devices):
                return f"{where} devices must be distinct, not {list(p.devices)}"
        return self._structure_inconsistency()

    def _structure_inconsistency(self) -> str | None:
        """The structural fields: devices that exist, names given once, finite figures."""
        n = self.num_devices
        homes = [m for m, _ in self.model_homes]
        for i, (model, devs) in enumerate(self.model_homes):
            bad = [d for d in devs if not 0 <= d < n]
            if bad:
                return (f"model_homes[{i}] (model '{model}') devices must lie in 0..{n - 1}, "
                        f"not include {bad[0]}")
            if not devs or len(set(devs)) != len(devs):
                return f"model_homes[{i}] (model '{model}') must list distinct devices, " \
                       f"not {list(devs)}"
            if homes.count(model) > 1:
                return f"model_homes must name model '{model}' once, not {homes.count(model)} times"
        named = [s for s, _ in self.staleness]
        for i, (stage, k) in enumerate(self.staleness):
            if not 0 <= k <= MAX_STALENESS:
                return f"staleness[{i}] (stage '{stage}') must be 0..{MAX_STALENESS}, not {k}"
            if named.count(stage) > 1:
                return f"staleness must name stage '{stage}' once, not {named.count(stage)} times"
        for field, groups in (("shared", self.shared), ("fusion", self.fusion)):
            for i, group in enumerate(groups):
                if len(group) < 2 or len(set(group)) != len(group):
                    return f"{field}[{i}] must list at least two distinct names, not " \
                           f"{list(group)}"
        pr = self.predicted
        if pr is not None:
            values = [("step_time_s", pr.step_time_s), ("tokens_per_s", pr.tokens_per_s),
                      ("memory_capacity", pr.memory_capacity), ("control_s", pr.control_s)]
            values += [(f"peak_memory[{i}]", x) for i, x in enumerate(pr.peak_memory)]
            values += [(f"op_times '{op}'", x) for op, x in pr.op_times]
            for what, x in values:
                if not 0 <= x < float("inf"):
                    return f"predicted {what} must be a finite number >= 0, not {x}"
        return _search_inconsistency(self.search)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            st = Path(path).stat()
            if not stat.S_ISREG(st.st_mode):     # a pipe or device would block or never end
                raise PlanError("plan file must be a regular file, not a directory, pipe or "
                                "device", Span(str(path), 0, 0))
            if st.st_size > MAX_PLAN_BYTES:
                raise PlanError(f"plan file must be at most {MAX_PLAN_BYTES:,} bytes, not "
                                f"{st.st_size:,}", Span(str(path), 0, 0))
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PlanError(f"plan file must be readable, not {e.strerror.lower()}",
                            Span(str(path), 0, 0)) from None
        except UnicodeDecodeError:
            raise PlanError("plan file must be UTF-8 text, not binary",
                            Span(str(path), 0, 0)) from None
        return cls.from_json(text, str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    # --- text form ------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"plan {self.pipeline} on {self.cluster} ({self.num_devices} devices, "
                 f"strategy {self.strategy.value}, seed {self.seed})"]
        rows = [("stage", "devices", "dp", "tp", "pp", "mb", "zero", "chunks", "engine")]
        for p in self.placements:
            rows.append((p.stage, device_ranges(p.devices), str(p.dp), str(p.tp), str(p.pp),
                         str(p.microbatches) + ("r" if p.recompute else ""),
                         str(p.zero) + ("o" if p.offload else ""),
                         str(p.chunks), p.engine.value))
        lines += _table(rows, indent="  ", right=(2, 3, 4, 5, 6, 7))
        for stage, k in self.staleness:
            lines.append(f"  staleness {stage} = {k}")
        for p in self.placements:
            if p.carry:
                lines.append(f"  carry {p.stage} = {p.carry}")
            if p.max_num_seqs or p.kv_fraction or p.cuda_graph:
                lines.append(f"  concurrency {p.stage} = {p.max_num_seqs or 'memory'} sequences"
                             + (f", kv_fraction {p.kv_fraction:g}" if p.kv_fraction else "")
                             + (", cuda_graph" if p.cuda_graph else ""))
        for group in self.shared:
            lines.append(f"  share {', '.join(group)}")
        for group in self.fusion:
            lines.append(f"  fuse {' + '.join(group)}")
        for model, devs in self.model_homes:
            lines.append(f"  home {model} on {device_ranges(devs)}")
        if self.predicted is not None:
            pr = self.predicted
            lines.append(f"  predicted step {pr.step_time_s:.3f} s, "
                         f"{pr.tokens_per_s:.0f} tokens/s")
            if pr.control_s:
                lines.append(f"  of which the control plane {pr.control_s:.3f} s "
                             f"({pr.tasks_per_step} Dask tasks a step)")
            if pr.peak_memory:
                lines.append(f"  predicted peak memory {max(pr.peak_memory) / 1e9:.1f} GB of "
                             f"{pr.memory_capacity / 1e9:.1f} GB per device"
                             + (f" ({pr.memory_reserve / 1e9:.1f} GB of it kept in reserve)"
                                if pr.memory_reserve else ""))
            for m in pr.memory:
                kinds = ", ".join(f"{k.replace('_', ' ')} {getattr(m, k) / 1e9:.2f}" for k in (
                    "weights", "grads", "optimizer", "activations", "kv_cache", "buffers")
                    if getattr(m, k))
                lines.append(f"    devices {device_ranges(m.devices)}: {kinds} GB"
                             + (f" (at {m.op})" if m.op else ""))
            for u in pr.ops:
                lines.append(f"  op {u.stage}: {u.time_s:.3g} s, {si(u.flops, 'FLOP')}, "
                             f"{si(u.bytes, 'B')} moved, MFU {100 * u.mfu:.0f}%, "
                             f"MBU {100 * u.mbu:.0f}%")
        return "\n".join(lines)


def si(x: float, unit: str) -> str:
    """``x`` with the largest SI prefix that keeps it at or above 1 (3 significant digits).

        >>> si(2.24e16, "FLOP"), si(512.0, "B"), si(1.0042e18, "FLOP")
        ('22.4 PFLOP', '512 B', '1 EFLOP')
    """
    for prefix, f in (("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9),
                      ("M", 1e6), ("k", 1e3)):
        if x >= f:
            return f"{x / f:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def device_ranges(devices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out: list[str] = []
    run: list[int] = []
    for d in sorted(devices):
        if run and d == run[-1] + 1:
            run.append(d)
            continue
        if run:
            out.append(_run(run))
        run = [d]
    if run:
        out.append(_run(run))
    return ",".join(out) or "-"


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def _table(rows, indent: str = "", right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


# --- plain JSON values <-> attrs values --------------------------------------------------

def _to_plain(v: object) -> object:
    if isinstance(v, StagePlacement):
        return {k: _to_plain(x) for k, x in v.plain().items()}
    if attrs.has(type(v)):
        return {f.name: _to_plain(getattr(v, f.name)) for f in attrs.fields(type(v))}
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return [_to_plain(x) for x in v]
    if isinstance(v, frozenset):
        return sorted(_to_plain(x) for x in v)
    return v


MAX_JSON_DEPTH = 32          # a plan nests a few levels; deeper is not a plan
MAX_INT_DIGITS = 20          # beyond any count or seed a plan holds


def read_json_text(text: str, path: str, what: str) -> object:
    """``text`` parsed as JSON for a plan (or another small rpeg record): duplicate keys,
    ``NaN``/``Infinity``, integers of more than 20 digits and nesting deeper than 32
    levels are refused with a PlanError naming ``path`` (json would take the last of two
    keys, accept non-finite numbers, and fail on the others with an internal error)."""
    depth = _nesting(text)
    if depth > MAX_JSON_DEPTH:
        raise PlanError(f"{what} must nest at most {MAX_JSON_DEPTH} levels deep, not {depth}",
                        Span(path, 0, 0), hint="write plans with `rpeg compile -o plan.json`")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_bounded_int,
                          parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise PlanError(f"{what} must be JSON, and it is not: {e.msg} at line "
                        f"{e.lineno} column {e.colno}", Span(path, e.lineno, e.colno),
                        hint="write plans with `rpeg compile -o plan.json`") from None
    except ValueError as e:
        raise PlanError(f"{what} must hold {e}", Span(path, 0, 0),
                        hint="write plans with `rpeg compile -o plan.json`") from None


def _nesting(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings (json itself would recurse)."""
    deepest = depth = 0
    for m in _BRACKETS.finditer(text):
        ch = m.group()
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"each key once, not '{_cut(k)}' twice")
        out[k] = v
    return out


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"integers of at most {MAX_INT_DIGITS} digits, not one of "
                         f"{digits:,} digits ({_cut(text)})")
    return int(text)


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"finite numbers, not {_cut(text)}")
    return x


def _no_constant(text: str) -> float:
    raise ValueError(f"finite numbers, not {text}")


def _cut(text: str, width: int = 24) -> str:
    """A long value as it appears in a message: its start, and how long it was."""
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


# fields holding one attrs value each (None allowed where the field's default is None)
_NESTED = {"predicted": Predicted, "search": SearchRecord, "options": SearchOptions,
           "limits": Limits}

# the shape of each field holding lists: "int", "float", "str", or a tuple of shapes
# (("list", X): any number of X; ("pair", X, Y): exactly two)
_SHAPES: dict[str, object] = {
    "devices": ("list", "int"),
    "model_homes": ("list", ("pair", "str", ("list", "int"))),
    "staleness": ("list", ("pair", "str", "int")),
    "shared": ("list", ("list", "str")),
    "fusion": ("list", ("list", "str")),
    "peak_memory": ("list", "float"),
    "busy": ("list", "float"),
    "op_times": ("list", ("pair", "str", "float")),
    "missing": ("list", ("pair", "str", "str")),
    "zero": ("list", "int"),
    "lora_zero": ("list", "int"),
    "eval_zero": ("list", "int"),
    "families": ("list", "str"),
    "model_features": ("list", "str"),
    "dtypes": ("list", "str"),
}


def _from_plain(cls, data: dict, where: str):
    fields = {f.name: f for f in attrs.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise KeyError(f"unknown field '{where}{_cut(unknown[0])}'")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        kwargs[name] = _convert(name, f.type, value, where + name)
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in kwargs]
    if missing:
        raise KeyError(f"missing field '{where}{missing[0]}'")
    return cls(**kwargs)


def _placement(data: dict, where: str) -> StagePlacement:
    """A placement from its flat fields (:data:`PLACEMENT_FIELDS`), as _from_plain reads a
    value's."""
    types = dict(PLACEMENT_FIELDS)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise KeyError(f"unknown field '{where}{_cut(unknown[0])}'")
    for name in ("stage", "devices"):
        if name not in data:
            raise KeyError(f"missing field '{where}{name}'")
    kwargs = {name: _convert(name, types[name], value, where + name)
              for name, value in data.items()}
    return StagePlacement.of(**kwargs)


def _convert(name: str, typ: object, value: object, where: str) -> object:
    t = str(typ)
    if name == "placements":
        _expect(where, value, list)
        return tuple(_placement(_expect(f"{where}[{i}]", x, dict), f"{where}[{i}].")
                     for i, x in enumerate(value))
    if name in ("ops", "memory"):
        kind = OpUse if name == "ops" else MemoryUse
        return tuple(_from_plain(kind, _expect(f"{where}[{i}]", x, dict), f"{where}[{i}].")
                     for i, x in enumerate(_expect(where, value, list)))
    if name in _NESTED:
        return None if value is None else _from_plain(
            _NESTED[name], _expect(where, value, dict), where + ".")
    if name in ("strategy", "engine", "method", "start"):
        kind = {"strategy": Strategy, "engine": Engine, "method": Method, "start": Start}[name]
        return kind(_expect(where, value, str))
    if name in ("engines", "carry_engines"):
        return frozenset(Engine(_expect(f"{where}[{i}]", x, str))
                         for i, x in enumerate(_expect(where, value, list)))
    if name == "engine_batching":
        return tuple((Engine(_shape(("pair", "str", ("list", "str")), x, f"{where}[{i}]")[0]),
                      tuple(x[1])) for i, x in enumerate(_expect(where, value, list)))
    if name == "engine_kv":
        return tuple(_engine_kv(x, f"{where}[{i}]")
                     for i, x in enumerate(_expect(where, value, list)))
    if name == "engine_tp":
        return tuple((Engine(_shape(("pair", "str", "int"), x, f"{where}[{i}]")[0]), x[1])
                     for i, x in enumerate(_expect(where, value, list)))
    if name in _SHAPES and t.startswith(("tuple", "frozenset")):
        got = _shape(_SHAPES[name], value, where)
        return frozenset(got) if t.startswith("frozenset") else got
    if t == "Zero":
        level = _shape("int", value, where)
        if level not in set(Zero):
            raise ValueError(f"'{where}' must be a ZeRO level 0..3, not {level}")
        return Zero(level)
    if t == "int | None":
        return None if value is None else _shape("int", value, where)
    if t == "float":
        return float(_shape(t, value, where))
    if t in ("int", "str"):
        return _shape(t, value, where)
    if t == "bool":
        _expect(where, value, bool)
        return value
    raise TypeError(f"'{where}' is not a field rpeg reads")


def _engine_kv(value: object, where: str) -> tuple:
    """An ``engine_kv`` entry: [engine, GPU share, CPU bytes]."""
    got = _shape(("list", "float"), value[1:], where) if isinstance(value, list) else None
    if got is None or len(value) != 3 or not isinstance(value[0], str):
        raise TypeError(f"'{where}' must be [engine, share, bytes], not {_show(value)}")
    return Engine(value[0]), float(got[0]), _shape("int", value[2], f"{where}[2]")


def _shape(shape: object, value: object, where: str) -> object:
    """``value`` checked against ``shape`` (see _SHAPES), lists made tuples."""
    if shape == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"'{where}' must be an integer, not {_show(value)}")
        return value
    if shape == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"'{where}' must be a number, not {_show(value)}")
        return value                      # as written: a whole number stays an int
    if shape == "str":
        if not isinstance(value, str):
            raise TypeError(f"'{where}' must be a string, not {_show(value)}")
        return value
    kind, *parts = shape
    if not isinstance(value, list):
        raise TypeError(f"'{where}' must be a list, not {_show(value)}")
    if kind == "pair":
        if len(value) != 2:
            raise TypeError(f"'{where}' must be a pair, not a list of {len(value)}")
        return tuple(_shape(p, v, f"{where}[{i}]")
                     for i, (p, v) in enumerate(zip(parts, value, strict=True)))
    return tuple(_shape(parts[0], v, f"{where}[{i}]") for i, v in enumerate(value))


def _show(value: object) -> str:
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
    return _cut(json.dumps(value))


def _expect(where: str, value: object, typ: type) -> object:
    if not isinstance(value, typ):
        names = {dict: "JSON object", list: "list", str: "string", bool: "true or false"}
        raise TypeError(f"'{where}' must be a {names.get(typ, typ.__name__)}, not "
                        f"{_show(value)}")
    return value


def _search_inconsistency(search) -> str | None:
    """The recorded search options outside what ``rpeg compile`` takes (``rpeg compile
    PLAN.json`` searches with them again)."""
    if search is None:
        return None
    from rpeg.plan.options import MAX_ITERATIONS, MAX_SEED
    o = search.options
    for what, x, low, high in (("seed", o.seed, 0, MAX_SEED),
                               ("iterations", o.iterations, 1, MAX_ITERATIONS),
                               ("patience", o.patience, 0, MAX_ITERATIONS),
                               ("chains", o.chains, 1, MAX_ITERATIONS)):
        if not low <= x <= high:
            return f"search.options.{what} must be {low:,}..{high:,}, not {x:,}"
    if not 0 < o.time_cap_s < float("inf"):
        return f"search.options.time_cap_s must be a positive number, not {o.time_cap_s}"
    return None


def _describe(e: Exception) -> str:
    text = str(e.args[0]) if e.args else str(e)
    if isinstance(e, ValueError) and "is not a valid" in text:
        return text.replace("is not a valid", "is not a known")
    return text
