"""The execution plan: one immutable value for searched, baseline and hand-written plans.

    >>> plan = Plan(pipeline="tiny", cluster="local_cpu", num_devices=2,
    ...             placements=(StagePlacement("rollout", (0, 1), dp=2),))
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
import json
import stat
from pathlib import Path

import attrs

from rpeg.errors import PlanError, Span
from rpeg.plan.options import Method, SearchOptions, SearchRecord, Start
from rpeg.plan.space import Limits
from rpeg.spec.model import Engine

SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 64 * 1024 * 1024      # checked before reading: a plan is kilobytes
MAX_PLAN_DEVICES = 1 << 20             # as for clusters (rpeg.spec.cluster.MAX_GPUS)
MAX_CARRY = 64                         # steps a partial rollout may span, beyond its own


class Strategy(enum.Enum):
    SEARCH = "search"
    COLOCATED = "colocated"
    SPLIT = "split"
    REALLOC = "realloc"
    MANUAL = "manual"


@attrs.frozen
class StagePlacement:
    stage: str
    devices: tuple[int, ...]          # global device indices, contiguous blocks
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    chunks: int = 1                   # generation streams finished responses in this many chunks
    engine: Engine = Engine.TORCH
    recompute: bool = False
    zero: int = 0                     # ZeRO level of a train stage (0 none .. 3 weights sharded)
    offload: bool = False             # train: optimizer state in host memory between steps
    carry: int = 0                    # generate: each response spans up to carry + 1 steps (a step
                                      # also advances the next carry steps' responses; partial
                                      # rollouts); 0: whole responses in their own step
    max_seqs: int = 0                 # generate: sequences one replica decodes at once (0: the
                                      # stage's max_seqs, else as many as memory holds)
    kv_fraction: float = 0.0          # generate: share of a device the engine may take (0: the
                                      # stage's kv_fraction, else what is free)


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


@attrs.frozen
class Plan:
    pipeline: str
    cluster: str
    num_devices: int
    placements: tuple[StagePlacement, ...]
    model_homes: tuple[tuple[str, tuple[int, ...]], ...] = ()   # model -> devices holding its weights
    staleness: tuple[tuple[str, int], ...] = ()                 # stage -> chosen bound (<= spec's)
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

    def placement(self, stage: str) -> StagePlacement:
        for p in self.placements:
            if p.stage == stage:
                return p
        raise PlanError(f"plan for '{self.pipeline}' must place stage '{stage}', not omit it")

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
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file must be JSON, not fail to parse ({e.msg} at line "
                            f"{e.lineno} column {e.colno})", Span(path, e.lineno, e.colno),
                            hint="write plans with `rpeg compile -o plan.json`") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: object, path: str = "<plan>") -> Plan:
        where = Span(path, 0, 0)
        if not isinstance(data, dict):
            raise PlanError(f"plan must be a JSON object, not {type(data).__name__}", where)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan schema_version must be {SCHEMA_VERSION}, not {version!r}",
                            where, hint="recompile the spec with this rpeg "
                                        "(`rpeg compile FILE.rpeg --cluster CLUSTER.rpeg`)")
        try:
            plan = _from_plain(cls, data)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan must hold well-formed fields, not: {_describe(e)}",
                            where, hint="recompile, or compare with a plan rpeg wrote") from None
        problem = plan.inconsistency()
        if problem:
            raise PlanError(problem, where, hint="recompile, or fix the placement by hand")
        return plan

    def inconsistency(self) -> str | None:
        """What makes this plan impossible to execute as written, or None."""
        if not 1 <= self.num_devices <= MAX_PLAN_DEVICES:
            return f"num_devices must be 1..{MAX_PLAN_DEVICES:,}, not {self.num_devices:,}"
        seen = set()
        for p in self.placements:
            if p.stage in seen:
                return f"stage '{p.stage}' must be placed once, not twice"
            seen.add(p.stage)
            if min(p.dp, p.tp, p.pp, p.microbatches, p.chunks) < 1:
                return f"stage '{p.stage}' degrees must be at least 1"
            if not 0 <= p.carry <= MAX_CARRY:
                return f"stage '{p.stage}' carry must be 0..{MAX_CARRY} steps, not {p.carry}"
            if not 0 <= p.max_seqs <= MAX_PLAN_DEVICES:
                return f"stage '{p.stage}' max_seqs must be 0..{MAX_PLAN_DEVICES:,}, not " \
                       f"{p.max_seqs}"
            if not 0.0 <= p.kv_fraction <= 1.0:
                return f"stage '{p.stage}' kv_fraction must be in 0..1, not {p.kv_fraction}"
            if max(p.microbatches, p.chunks) > MAX_PLAN_DEVICES:
                return f"stage '{p.stage}' micro-batches and chunks must be at most " \
                       f"{MAX_PLAN_DEVICES:,}"
            if len(p.devices) != p.dp * p.tp * p.pp:
                return (f"stage '{p.stage}' must run on dp x tp x pp = {p.dp * p.tp * p.pp} "
                        f"devices, not {len(p.devices)}")
            bad = [d for d in p.devices if not 0 <= d < self.num_devices]
            if bad:
                return (f"stage '{p.stage}' devices must lie in 0..{self.num_devices - 1}, "
                        f"not include {bad[0]}")
        return None

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
            if p.max_seqs or p.kv_fraction:
                lines.append(f"  concurrency {p.stage} = {p.max_seqs or 'memory'} sequences"
                             + (f", kv_fraction {p.kv_fraction:g}" if p.kv_fraction else ""))
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
                             f"({pr.tasks_per_step} Dask tasks a step, on the devices' cores)")
            if pr.peak_memory:
                lines.append(f"  predicted peak memory {max(pr.peak_memory) / 1e9:.1f} GB of "
                             f"{pr.memory_capacity / 1e9:.1f} GB per device")
        return "\n".join(lines)


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
    if attrs.has(type(v)):
        return {f.name: _to_plain(getattr(v, f.name)) for f in attrs.fields(type(v))}
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return [_to_plain(x) for x in v]
    if isinstance(v, frozenset):
        return sorted(_to_plain(x) for x in v)
    return v


# fields holding one attrs value each (None allowed where the field's default is None)
_NESTED = {"predicted": Predicted, "search": SearchRecord, "options": SearchOptions,
           "limits": Limits}


def _from_plain(cls, data: dict):
    fields = {f.name: f for f in attrs.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise KeyError(f"unknown field '{unknown[0]}'")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        kwargs[name] = _convert(name, f.type, value)
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in kwargs]
    if missing:
        raise KeyError(f"missing field '{missing[0]}'")
    return cls(**kwargs)


def _convert(name: str, typ: object, value: object) -> object:
    t = str(typ)
    if name == "placements":
        _expect(name, value, list)
        return tuple(_from_plain(StagePlacement, _expect(name, x, dict)) for x in value)
    if name in _NESTED:
        return None if value is None else _from_plain(_NESTED[name], _expect(name, value, dict))
    if name == "strategy":
        return Strategy(value)
    if name == "engine":
        return Engine(value)
    if name in ("engines", "carry_engines"):
        return frozenset(Engine(x) for x in _expect(name, value, list))
    if name == "engine_tp":
        return tuple((Engine(_expect(name, x, list)[0]), _convert("max_tp", "int", x[1]))
                     for x in _expect(name, value, list))
    if t.startswith("frozenset"):
        return frozenset(_tuples(name, _expect(name, value, list)))
    if name == "method":
        return Method(value)
    if name == "start":
        return Start(value)
    if t == "int | None":
        return None if value is None else _convert(name, "int", value)
    if t.startswith("tuple"):
        return _tuples(name, value)
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"'{name}' must be an integer, not {value!r}")
        return value
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"'{name}' must be a number, not {value!r}")
        return float(value)
    if t == "bool":
        _expect(name, value, bool)
        return value
    if t == "str":
        _expect(name, value, str)
        return value
    return value


def _tuples(name: str, value: object) -> object:
    if isinstance(value, list):
        return tuple(_tuples(name, x) for x in value)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return value
    raise TypeError(f"'{name}' must hold lists, numbers and names, not {value!r}")


def _expect(name: str, value: object, typ: type) -> object:
    if not isinstance(value, typ):
        raise TypeError(f"'{name}' must be a {typ.__name__}, not {value!r}")
    return value


def _describe(e: Exception) -> str:
    text = str(e.args[0]) if e.args else str(e)
    if isinstance(e, ValueError) and "is not a valid" in text:
        return text.replace("is not a valid", "is not a known")
    return text
