"""What changed between two pipelines, in meaning rather than in text: ``rpeg diff``.

    >>> from rpeg.spec import load
    >>> d = diff(load("pipelines/ppo_llama8b.rpeg"), load("pipelines/ppo_async.rpeg"))  # doctest: +SKIP
    >>> print(d.text())                                                                  # doctest: +SKIP
    --- pipelines/ppo_llama8b.rpeg (ppo_llama8b)
    +++ pipelines/ppo_async.rpeg (ppo_async)
    staleness
      ~ rollout: 1 -> 2  (generation may use weights up to 2 updates old, was 1)
      ~ values: 0 -> 1  (may read critic weights up to 1 update old, was synchronous)

Both pipelines are compared after ``extend`` is resolved. Things are matched by
name first, then by what they are: a model, reward or stage renamed but
otherwise equal is a *rename*, not a change, and data renamed consistently
(produced by the matching output of a matching stage, read by matching stages)
is not a change either. Renames are listed (``renames``) but do not make two
pipelines differ. Sections, in order: workload, models, rewards, tools, stages, edges,
staleness, sharing, colocation, placement. Two clusters compare by shape, GPU
profile and links (:func:`diff_clusters`).
"""

from __future__ import annotations

import enum
import json

import attrs

from rpeg.spec.model import WORKLOAD_DATA, Cluster, Model, Pipeline, Reward, Stage
from rpeg.spec.paths import FileRef

SECTIONS = ("workload", "models", "rewards", "tools", "stages", "edges", "staleness", "sharing",
            "colocation", "placement", "eval", "log", "cluster", "gpu", "links")


class ChangeKind(enum.Enum):
    ADDED = "+"
    REMOVED = "-"
    CHANGED = "~"


@attrs.frozen
class Change:
    section: str            # one of SECTIONS
    kind: ChangeKind
    name: str               # the thing's name (in B when it exists there, else in A)
    detail: str = ""        # what changed, in words
    before: str | None = None
    after: str | None = None

    def line(self) -> str:
        text = f"{self.kind.value} {self.name}"
        if self.before is not None or self.after is not None:
            text += f": {self.before if self.before is not None else '-'} -> " \
                    f"{self.after if self.after is not None else '-'}"
        if self.detail:
            text += f"  ({self.detail})"
        return text

    def to_dict(self) -> dict:
        return {"section": self.section, "kind": self.kind.name.lower(), "name": self.name,
                "detail": self.detail, "before": self.before, "after": self.after}


@attrs.frozen
class Rename:
    what: str               # pipeline, model, reward, stage, data
    before: str
    after: str


@attrs.frozen
class SpecDiff:
    a: str
    b: str
    a_name: str
    b_name: str
    changes: tuple[Change, ...]
    renames: tuple[Rename, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def text(self) -> str:
        """The diff for a person; '' when nothing changed (renames alone are no change)."""
        if not self.changes:
            return ""
        lines = [f"--- {self.a} ({self.a_name})", f"+++ {self.b} ({self.b_name})"]
        for section in SECTIONS:
            these = [c for c in self.changes if c.section == section]
            if these:
                lines.append(section)
                lines += ["  " + c.line() for c in these]
        if self.renames:
            lines.append("renamed (not a change)")
            lines += [f"  {r.what} {r.before} -> {r.after}" for r in self.renames]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "changed": self.changed,
                "changes": [c.to_dict() for c in self.changes],
                "renames": [attrs.asdict(r) for r in self.renames]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


# --- matching ----------------------------------------------------------------------------

def _model_sig(m: Model) -> tuple:
    return (m.preset, m.dims, m.head, m.frozen, m.optimizer, m.dtype, m.weights, m.lora)


def _reward_sig(r: Reward) -> tuple:
    return (r.kind, r.module, r.function, r.params, r.source)


def _match_by_sig(a: dict[str, object], b: dict[str, object], sig) -> dict[str, str]:
    """Same name first; then each unmatched thing of A to the first unmatched equal one of B."""
    out = {n: n for n in a if n in b}
    free_b = [n for n in b if n not in out.values()]
    for n in a:
        if n in out:
            continue
        hit = next((m for m in free_b if sig(a[n]) == sig(b[m])), None)
        if hit is not None:
            out[n] = hit
            free_b.remove(hit)
    return out


class _Matcher:
    """Maps names of A onto names of B: models, rewards, stages and data."""

    def __init__(self, a: Pipeline, b: Pipeline) -> None:
        self.a, self.b = a, b
        am = {m.name: m for m in a.models}
        bm = {m.name: m for m in b.models}
        self.models = _match_by_sig(am, bm, _model_sig)
        ar = {r.name: r for r in a.rewards}
        br = {r.name: r for r in b.rewards}
        self.rewards = _match_by_sig(ar, br, _reward_sig)
        self.targets = self.models | self.rewards
        self.data: dict[str, str] = {d: d for d in WORKLOAD_DATA}
        self.stages: dict[str, str] = {}
        self._match_stages()

    def target(self, name: str | None) -> str | None:
        return None if name is None else self.targets.get(name, f"{name}?")

    def datum(self, name: str) -> str:
        return self.data.get(name, f"{name}?")

    def _sig(self, s: Stage) -> tuple:
        return (s.function, self.target(s.target), tuple(self.datum(d) for d in s.inputs),
                len(s.outputs), _params(s))

    @staticmethod
    def _bsig(s: Stage) -> tuple:
        return (s.function, s.target, s.inputs, len(s.outputs), _params(s))

    def _bind(self, sa: Stage, sb: Stage) -> None:
        self.stages[sa.name] = sb.name
        for x, y in zip(sa.outputs, sb.outputs, strict=False):
            self.data.setdefault(x, y)

    def _match_stages(self) -> None:
        b_by_name = {s.name: s for s in self.b.stages}
        pending = list(self.a.stages)
        # stages of one name are the same stage; what they produce is matched by position
        for sa in pending:
            if sa.name in b_by_name:
                self._bind(sa, b_by_name[sa.name])
        # the others: in dataflow order, a stage equal to an unmatched one of B is a rename
        free = [s for s in self.b.stages if s.name not in self.stages.values()]
        progress = True
        while progress:
            progress = False
            for sa in pending:
                if sa.name in self.stages:
                    continue
                if any(d not in self.data for d in sa.inputs):
                    continue
                hit = next((sb for sb in free if self._bsig(sb) == self._sig(sa)), None)
                if hit is not None:
                    self._bind(sa, hit)
                    free.remove(hit)
                    progress = True

    def renames(self) -> tuple[Rename, ...]:
        out = []
        if self.a.name != self.b.name:
            out.append(Rename("pipeline", self.a.name, self.b.name))
        for what, mapping in (("model", self.models), ("reward", self.rewards),
                              ("stage", self.stages), ("data", self.data)):
            out += [Rename(what, x, y) for x, y in mapping.items() if x != y]
        return tuple(out)


def _params(s: Stage) -> tuple:
    """A stage's keywords as written, less those written at their default (the registry's):
    ``temperature = 1.0`` and no temperature are one stage."""
    from rpeg.spec.functions import function
    fn = function(s.function)

    def at_default(key: str, value) -> bool:
        try:
            p = fn.param(key)
        except (KeyError, ValueError):
            return False
        if p.derived or p.default is None:
            return False
        default = p.default.value if isinstance(p.default, enum.Enum) else p.default
        value = value.value if isinstance(value, enum.Enum) else value
        if isinstance(value, bool) or isinstance(default, bool):   # True is no 1
            return value is default
        return value == default
    return tuple(sorted((k, str(v)) for k, v in s.params if not at_default(k, v)))


# --- comparing -------------------------------------------------------------------------

def diff(a: Pipeline, b: Pipeline) -> SpecDiff:
    """The semantic difference between pipelines ``a`` and ``b`` (both extend-resolved)."""
    m = _Matcher(a, b)
    changes: list[Change] = []
    changes += _workload(a, b)
    changes += _things("models", a.models, b.models, m.models, _model_fields, _describe_model)
    changes += _things("rewards", a.rewards, b.rewards, m.rewards,
                       lambda r, _m: {"function": str(r), "source": r.source or "none"}, str)
    changes += _things("tools", a.tools, b.tools, {t.name: t.name for t in a.tools
                                                   if any(u.name == t.name for u in b.tools)},
                       _tool_fields, str)
    changes += _stages(a, b, m)
    changes += _edges(a, b, m)
    changes += _staleness(a, b, m)
    changes += _groups("sharing", a.shares, b.shares, m.models, "may share one backbone")
    changes += _groups("colocation", a.colocate, b.colocate, m.stages | m.targets,
                       "pinned to the same devices")
    changes += _placement(a, b, m)
    changes += _blocks(a, b)
    return SpecDiff(a.path, b.path, a.name, b.name, tuple(changes), m.renames())


def _workload(a: Pipeline, b: Pipeline) -> list[Change]:
    wa, wb = a.workload, b.workload
    out = []
    meanings = {"prompts": "prompts per step", "samples": "responses per prompt",
                "prompt_len": "prompt tokens", "gen_len": "generated tokens",
                "fields": "dataset columns", "template": "prompt rendering",
                "prompt_dist": "prompt lengths", "truncation": "a prompt over prompt_len",
                "checkpoint_every": "steps between checkpoints",
                "keep_checkpoints": "complete checkpoints kept"}
    fields = [(f.name, meanings.get(f.name, "")) for f in attrs.fields(type(wa))
              if f.name not in ("span", "keys")]         # every key the workload holds
    for key, meaning in fields:
        x, y = getattr(wa, key), getattr(wb, key)
        if _differs(x, y):
            detail = meaning
            if key in ("prompts", "samples") and wa.batch != wb.batch:
                detail += f", responses per step {wa.batch} -> {wb.batch}"
            if key == "gen_len":
                detail += f", mean {wa.gen_len.mean():.0f} -> {wb.gen_len.mean():.0f}"
            out.append(Change("workload", ChangeKind.CHANGED, key, detail, *_pair(x, y)))
    return out


def _differs(x: object, y: object) -> bool:
    """A file a spec names differs by its path (one text may name two files); anything
    else by how it reads."""
    if isinstance(x, FileRef) or isinstance(y, FileRef):
        return x != y
    return str(x) != str(y)


def _pair(x: object, y: object) -> tuple[str, str]:
    """Two values as a change shows them: files by their paths where the texts agree."""
    if isinstance(x, FileRef) and isinstance(y, FileRef) and x.text == y.text:
        return x.path, y.path
    return _s(x), _s(y)


def _s(v: object) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    return "none" if v is None else str(v)


def _listed(v: object) -> str:
    return ", ".join(_s(t) for t in v) if isinstance(v, tuple) else _s(v)


def _blocks(a: Pipeline, b: Pipeline) -> list[Change]:
    """The eval and log blocks, field by field (an eval block added or removed whole)."""
    out = []
    ea, eb = a.evaluation, b.evaluation
    if (ea is None) != (eb is None):
        kind = ChangeKind.ADDED if ea is None else ChangeKind.REMOVED
        e = eb or ea
        out.append(Change("eval", kind, "eval", f"{e.dataset} every {e.every} steps, "
                                                f"{e.samples} sample(s) per prompt"))
    for section, x, y in (("eval", ea, eb), ("log", a.log, b.log)):
        if x is None or y is None:
            continue
        for f in attrs.fields(type(x)):
            if f.name == "span":
                continue
            vx, vy = getattr(x, f.name), getattr(y, f.name)
            if vx != vy:
                shown = _pair(vx, vy) if isinstance(vx, FileRef) else (_listed(vx), _listed(vy))
                out.append(Change(section, ChangeKind.CHANGED, f"{section}.{f.name}", "",
                                  *shown))
    return out


def _model_fields(mo: Model, _m) -> dict[str, str]:
    out = {"preset": mo.preset, "head": mo.head.value, "frozen": str(mo.frozen).lower(),
           "dtype": mo.dtype, "weights": _s(mo.weights), "lora": _s(mo.lora)}
    for f in attrs.fields(type(mo.dims)):
        out[f"dims.{f.name}"] = str(getattr(mo.dims, f.name))
    if mo.optimizer is not None:
        for f in attrs.fields(type(mo.optimizer)):
            v = getattr(mo.optimizer, f.name)
            out[f"optimizer.{f.name}"] = f"{v:g}" if isinstance(v, float) else str(v)
    else:
        out["optimizer"] = "none"
    return out


def _describe_model(mo: Model) -> str:
    return (f"{mo.preset}, {_params_text(mo)} parameters, head {mo.head.value}"
            + (", frozen" if mo.frozen else ""))


def _params_text(mo: Model) -> str:
    n = mo.dims.param_count()
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _things(section, a_items, b_items, mapping, fields, describe) -> list[Change]:
    out = []
    b_by = {x.name: x for x in b_items}
    for x in a_items:
        if x.name not in mapping:
            out.append(Change(section, ChangeKind.REMOVED, x.name, describe(x)))
            continue
        y = b_by[mapping[x.name]]
        fx, fy = fields(x, None), fields(y, None)
        for key in dict.fromkeys(list(fx) + list(fy)):
            if fx.get(key) != fy.get(key):
                detail = ""
                if key == "preset" and isinstance(x, Model):
                    detail = f"{_params_text(x)} -> {_params_text(y)} parameters"
                if key.startswith("dims.") and "preset" in fx and fx["preset"] != fy["preset"]:
                    continue            # a new preset: its dimensions follow
                out.append(Change(section, ChangeKind.CHANGED, f"{y.name}.{key}", detail,
                                  fx.get(key, "none"), fy.get(key, "none")))
    for y in b_items:
        if y.name not in mapping.values():
            out.append(Change(section, ChangeKind.ADDED, y.name, describe(y)))
    return out


def _tool_fields(t, _m) -> dict[str, str]:
    """A tool's or environment's code and sandbox, field by field."""
    from rpeg.spec.tools import _s
    return {"kind": "environment" if t.environment else "tool", "code": t.ref,
            "source": t.source or "none",
            "timeout": _s(t.timeout), "memory": f"{t.memory:g} bytes",
            "max_output": f"{t.max_output:g} bytes", "cores": str(t.cores),
            "latency": str(t.latency) if t.latency is not None else "measured"}


def _stage_text(s: Stage) -> str:
    text = f"{s.function}({', '.join(([s.target] if s.target else []) + list(s.inputs))})"
    return text + (f" -> {', '.join(s.outputs)}" if s.outputs else "")


def _stages(a: Pipeline, b: Pipeline, m: _Matcher) -> list[Change]:
    out = []
    b_by = {s.name: s for s in b.stages}
    for sa in a.stages:
        if sa.name not in m.stages:
            out.append(Change("stages", ChangeKind.REMOVED, sa.name, _stage_text(sa)))
            continue
        sb = b_by[m.stages[sa.name]]
        name = sb.name
        if sa.function != sb.function:
            out.append(Change("stages", ChangeKind.CHANGED, f"{name}.function", "",
                              sa.function, sb.function))
        if m.target(sa.target) != sb.target:
            out.append(Change("stages", ChangeKind.CHANGED, f"{name}.runs", "",
                              _s(sa.target), _s(sb.target)))
        ins = tuple(m.datum(d) for d in sa.inputs)
        if ins != sb.inputs:
            added = [d for d in sb.inputs if d not in ins]
            gone = [d for d in sa.inputs if m.datum(d) not in sb.inputs]
            detail = "; ".join(x for x in (f"now reads {', '.join(added)}" if added else "",
                                           f"no longer reads {', '.join(gone)}" if gone else "",
                                           "order" if not added and not gone else "") if x)
            out.append(Change("stages", ChangeKind.CHANGED, f"{name}.inputs", detail,
                              ", ".join(sa.inputs) or "-", ", ".join(sb.inputs) or "-"))
        outs = tuple(m.data.get(d, d) for d in sa.outputs)
        if len(sa.outputs) != len(sb.outputs) or outs != sb.outputs:
            out.append(Change("stages", ChangeKind.CHANGED, f"{name}.outputs", "",
                              ", ".join(sa.outputs) or "-", ", ".join(sb.outputs) or "-"))
        pa, pb = dict(_params(sa)), dict(_params(sb))
        for key in dict.fromkeys(list(pa) + list(pb)):
            if pa.get(key) != pb.get(key):
                out.append(Change("stages", ChangeKind.CHANGED, f"{name}.{key}", "",
                                  pa.get(key, "default"), pb.get(key, "default")))
    for sb in b.stages:
        if sb.name not in m.stages.values():
            out.append(Change("stages", ChangeKind.ADDED, sb.name, _stage_text(sb)))
    return out


def _edge_set(p: Pipeline) -> set[tuple[str, str, str]]:
    producer = {d: s.name for s in p.stages for d in s.outputs}
    return {(producer[d], s.name, d) for s in p.stages for d in s.inputs if d in producer}


def _edges(a: Pipeline, b: Pipeline, m: _Matcher) -> list[Change]:
    """Data edges between stages present in both (edges of added or removed stages are
    implied by the stage change)."""
    both = set(m.stages.values())
    ea = {(m.stages[x], m.stages[y], m.datum(d)) for x, y, d in _edge_set(a)
          if x in m.stages and y in m.stages}
    eb = {e for e in _edge_set(b) if e[0] in both and e[1] in both}
    order = {s.name: n for n, s in enumerate(b.stages)}

    def key(e):
        return (order[e[0]], order[e[1]], e[2])

    out = [Change("edges", ChangeKind.REMOVED, f"{x} -> {y} [{d.rstrip('?')}]")
           for x, y, d in sorted(ea - eb, key=key)]
    out += [Change("edges", ChangeKind.ADDED, f"{x} -> {y} [{d}]")
            for x, y, d in sorted(eb - ea, key=key)]
    return out


def _lag_words(stage: Stage | None, k: int, was: int) -> str:
    what = "generation" if stage is not None and stage.function == "generate" else "the stage"
    model = stage.target if stage is not None and stage.target else "its model's"
    if k == 0:
        now = f"{what} reads the latest {model} weights (synchronous)"
    else:
        now = f"{what} may read {model} weights up to {k} update{'s' if k > 1 else ''} old"
    return now + (", was synchronous" if was == 0 else f", was {was}")


def _staleness(a: Pipeline, b: Pipeline, m: _Matcher) -> list[Change]:
    out = []
    names = list(dict.fromkeys([m.stages.get(s, s) for s, _ in a.staleness]
                               + [s for s, _ in b.staleness]))
    back = {v: k for k, v in m.stages.items()}
    for name in names:
        ka = a.staleness_of(back[name]) if name in back else 0
        kb = b.staleness_of(name)
        if ka != kb:
            stage = next((s for s in b.stages if s.name == name), None)
            detail = _lag_words(stage, kb, ka)
            out.append(Change("staleness", ChangeKind.CHANGED, name, detail, str(ka), str(kb)))
    return out


def _groups(section, ga, gb, mapping, meaning) -> list[Change]:
    sa = [frozenset(mapping.get(x, f"{x}?") for x in g) for g in ga]
    sb = [frozenset(g) for g in gb]
    out = [Change(section, ChangeKind.REMOVED, ", ".join(g), f"no longer {meaning}")
           for g, s in zip(ga, sa, strict=True) if s not in sb]
    out += [Change(section, ChangeKind.ADDED, ", ".join(g), meaning)
            for g, s in zip(gb, sb, strict=True) if s not in sa]
    return out


def _placement(a: Pipeline, b: Pipeline, m: _Matcher) -> list[Change]:
    pa = {m.stages.get(p.stage, f"{p.stage}?"): p for p in a.place}
    pb = {p.stage: p for p in b.place}
    out = []
    for s in dict.fromkeys(list(pa) + list(pb)):
        x, y = pa.get(s), pb.get(s)
        rx = f"{x.first}..{x.last}" if x else None
        ry = f"{y.first}..{y.last}" if y else None
        if rx != ry:
            kind = ChangeKind.ADDED if x is None else ChangeKind.REMOVED if y is None \
                else ChangeKind.CHANGED
            out.append(Change("placement", kind, s, "pinned to GPUs", rx, ry))
        lx, ly = dict(x.pinned()) if x else {}, dict(y.pinned()) if y else {}
        for key in dict.fromkeys(list(lx) + list(ly)):
            if lx.get(key) != ly.get(key):
                kind = ChangeKind.ADDED if key not in lx else ChangeKind.REMOVED \
                    if key not in ly else ChangeKind.CHANGED
                out.append(Change("placement", kind, f"{s}.{key}", "pinned layout",
                                  _pin_text(lx.get(key)), _pin_text(ly.get(key))))
    return out


def _pin_text(v: object) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    return getattr(v, "value", str(v))


# --- clusters -----------------------------------------------------------------------------

def diff_clusters(a: Cluster, b: Cluster) -> SpecDiff:
    """What differs between two clusters: shape, the GPU profile's figures, and the links."""
    out = []
    for key, attr in (("gpus_per_node",) * 2, ("nodes_per_rack",) * 2, ("racks",) * 2,
                      ("num_gpus",) * 2, ("tool_cores", "tool_cores_per_node")):
        x, y = getattr(a, attr), getattr(b, attr)
        if x != y:
            out.append(Change("cluster", ChangeKind.CHANGED, key, "", str(x), str(y)))
    ga, gb = a.gpu, b.gpu
    if ga.name != gb.name:
        out.append(Change("gpu", ChangeKind.CHANGED, "name", "", ga.name, gb.name))
    for f in attrs.fields(type(ga)):
        if f.name in ("name", "source"):
            continue
        x, y = getattr(ga, f.name), getattr(gb, f.name)
        if x != y:
            unit = f.metadata.get("unit", "")
            rel = f"{(y - x) / x:+.1%}" if x and y is not None else ""
            out.append(Change("gpu", ChangeKind.CHANGED, f.name, rel, _figure(x, unit),
                              _figure(y, unit)))
    la = {link.level: link for link in a.links}
    lb = {link.level: link for link in b.links}
    for level in sorted(set(la) | set(lb)):
        x, y = la.get(level), lb.get(level)
        name = level.name.lower()
        if x is None or y is None:
            kind = ChangeKind.ADDED if x is None else ChangeKind.REMOVED
            link = y if x is None else x
            out.append(Change("links", kind, name, f"{_quantity(link.bandwidth, 'bytes/s')}, "
                                                   f"{_quantity(link.latency, 's')}"))
            continue
        for key, unit in (("bandwidth", "bytes/s"), ("latency", "s")):
            if getattr(x, key) != getattr(y, key):
                out.append(Change("links", ChangeKind.CHANGED, f"{name}.{key}", "",
                                  _quantity(getattr(x, key), unit),
                                  _quantity(getattr(y, key), unit)))
    renames = (Rename("cluster", a.name, b.name),) if a.name != b.name else ()
    return SpecDiff(a.path, b.path, a.name, b.name, tuple(out), renames)


_UNITS = {"bytes": (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)),
          "bytes/s": (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("B/s", 1.0)),
          "flops": (("PFLOPS", 1e15), ("TFLOPS", 1e12), ("GFLOPS", 1e9), ("FLOPS", 1.0)),
          "s": (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))}


def _figure(x: float | None, unit: str) -> str:
    return _s(x) if x is None else _quantity(x, unit)


def _quantity(x: float, unit: str) -> str:
    """A figure in the unit that keeps it at or above 1, as a spec would write it."""
    for name, factor in _UNITS.get(unit, ()):
        if abs(x) >= factor:
            return f"{x / factor:.4g} {name}"
    return f"{x:.4g}"
