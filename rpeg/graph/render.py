"""Pictures of the RPEG graph: Graphviz DOT of one step or of N unrolled steps.

    >>> from rpeg.spec import load
    >>> from rpeg.graph import Graph
    >>> g = build(load("pipelines/ppo_llama8b.rpeg"))      # doctest: +SKIP
    >>> dot = to_dot(g, steps=3)                                          # doctest: +SKIP
    >>> write(dot, "ppo.svg")                                             # doctest: +SKIP

What the picture shows:

- an op is a box coloured by kind (generate blue, forward yellow, score green,
  compute grey, train red, weight sync orange); an op on a shared backbone has
  a double border and names the models merged into it;
- a data edge (inside one step) is a solid grey arrow labelled with the data;
- a parameter-version edge is dashed, coloured per model and labelled with the
  model and its lag ("actor, lag 1": the reader at step s needs the version the
  writer made at step s-1-lag); the weight-sync edge from a train op to its
  sync op is bold orange;
- unrolled, each step is one box (``cluster_step0``...), a chunked op has one
  node per chunk, and version edges run from one step's box to a later one.

The DOT text is deterministic (golden-testable); SVG and PNG come from the
``dot`` program of Graphviz.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from rpeg.errors import GraphError
from rpeg.graph.ir import SAME_STEP, Graph, Op
from rpeg.graph.unroll import DepKind, Instance, Unrolled, unroll
from rpeg.spec.model import OpKind

FORMATS = ("dot", "svg", "png", "pdf")

_FILL = {
    OpKind.GENERATE: "#cfe2ff",
    OpKind.FORWARD: "#fff3bf",
    OpKind.SCORE: "#d3f9d8",
    OpKind.COMPUTE: "#e9ecef",
    OpKind.TRAIN: "#ffc9c9",
    OpKind.SYNC_WEIGHTS: "#ffd8a8",
}
_SHAPE = {OpKind.TRAIN: "box3d", OpKind.SYNC_WEIGHTS: "cds", OpKind.COMPUTE: "box"}
_MODEL_COLOURS = ("#1c7ed6", "#ae3ec9", "#0ca678", "#f59f00", "#e8590c", "#495057")
SYNC_COLOUR = "#e8590c"
DATA_COLOUR = "#868e96"

LEGEND = ("solid grey: data inside a step   dashed: parameter version (model, lag)   "
          "bold orange: weight sync")


def _q(s: str) -> str:
    """A DOT double-quoted string."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**kw: object) -> str:
    parts = [f"{k}={_q(str(v)) if not isinstance(v, bool) else str(v).lower()}"
             for k, v in kw.items() if v is not None]
    return "[" + ", ".join(parts) + "]"


class _Style:
    """Colours per model and the labels of ops, shared by both views."""

    def __init__(self, g: Graph) -> None:
        models = sorted({e.model for e in g.version_edges})
        self.colour = {m: _MODEL_COLOURS[n % len(_MODEL_COLOURS)] for n, m in enumerate(models)}
        self.members = dict(g.shared)
        self.graph = g

    def op_attrs(self, op: Op, label: str) -> str:
        model = op.writes_model or op.reads_model
        shared = model in self.members
        if model:
            label += f"\n{op.kind.value} · {model}"
            if shared:
                label += f"\nshared: {', '.join(self.members[model])}"
        else:
            label += f"\n{op.kind.value}"
        return _attrs(label=label, shape=_SHAPE.get(op.kind, "box"),
                      fillcolor=_FILL[op.kind], peripheries=2 if shared else None,
                      tooltip=self.tooltip(op))

    def tooltip(self, op: Op) -> str:
        return (f"{op.name}: {op.kind.value}; reads {', '.join(op.inputs) or '-'}; "
                f"writes {', '.join(op.outputs) or '-'}")

    def version_attrs(self, model: str, lag: int, label: bool = True) -> str:
        if lag == SAME_STEP:
            return _attrs(color=SYNC_COLOUR, penwidth=2.5, style="bold",
                          label=f"{model} weights" if label else None, fontcolor=SYNC_COLOUR)
        c = self.colour.get(model, _MODEL_COLOURS[0])
        return _attrs(color=c, fontcolor=c, style="dashed", penwidth=1.5,
                      label=f"{model}, lag {lag}" if label else None)


def _header(name: str, title: str, rankdir: str) -> list[str]:
    return [
        f"digraph {_q(name)} {{",
        f"  graph {_attrs(rankdir=rankdir, fontname='Helvetica', fontsize=12, labelloc='t', label=title, newrank=True, nodesep=0.3, ranksep=0.45)};",  # noqa: E501
        "  node [fontname=\"Helvetica\", fontsize=10, style=\"rounded,filled\", "
        "color=\"#495057\"];",
        "  edge [fontname=\"Helvetica\", fontsize=9, arrowsize=0.7];",
    ]


def _legend(style: _Style) -> list[str]:
    text = LEGEND
    for backbone, members in style.graph.shared:
        text += f"\\lshared backbone {backbone}: {', '.join(members)}"
    return [f"  legend [shape=plaintext, style=\"\", label=\"{text}\\l\", fontsize=9];"]


def step_dot(g: Graph) -> str:
    """DOT of the step graph: one node per op, data edges, version edges as dashed loops back."""
    style = _Style(g)
    lines = _header(g.name, f"{g.name}: one step", "TB")
    for op in g.ops:
        lines.append(f"  {_q(op.name)} {style.op_attrs(op, op.name)};")
    labels: dict[tuple[str, str], list[str]] = {}
    for e in g.data_edges:
        labels.setdefault((e.src, e.dst), []).append(e.data)
    for (src, dst), data in labels.items():
        lines.append(f"  {_q(src)} -> {_q(dst)} "
                     f"{_attrs(label=', '.join(data), color=DATA_COLOUR)};")
    for e in g.version_edges:
        attrs = style.version_attrs(e.model, e.lag)
        if not e.same_step:
            attrs = attrs[:-1] + ", constraint=false]"
        lines.append(f"  {_q(e.writer)} -> {_q(e.reader)} {attrs};")
    lines += _legend(style)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_id(i: Instance) -> str:
    return f"{i.op}@{i.step}" + (f"#{i.chunk}" if i.chunk else "")


def unrolled_dot(u: Unrolled) -> str:
    """DOT of ``steps`` unrolled steps: one box per step, version edges across the boxes."""
    g = u.graph
    style = _Style(g)
    ops = {o.name: o for o in g.ops}
    lines = _header(g.name, f"{g.name}: {u.steps} steps unrolled", "TB")
    for s in range(u.steps):
        lines.append(f"  subgraph {_q(f'cluster_step{s}')} {{")
        lines.append(f"    graph {_attrs(label=f'step {s}', style='rounded', color='#adb5bd')};")
        for i in u.instances:
            if i.step != s:
                continue
            n = u.chunks_of(i.op)
            label = i.op + (f" [{i.chunk + 1}/{n}]" if n > 1 else "")
            lines.append(f"    {_q(_node_id(i))} {style.op_attrs(ops[i.op], label)};")
        lines.append("  }")
    seen: set[tuple[str, str]] = set()
    for d in u.deps:
        key = (_node_id(d.src), _node_id(d.dst))
        if d.kind is DepKind.DATA:
            if key in seen:
                continue
            seen.add(key)
            data = sorted({x.data for x in u.deps if x.kind is DepKind.DATA
                           and x.src == d.src and x.dst == d.dst})
            lines.append(f"  {_q(key[0])} -> {_q(key[1])} "
                         f"{_attrs(color=DATA_COLOUR, tooltip=', '.join(data))};")
        elif d.kind is DepKind.ORDER:          # no data: order only (stream, carry, write)
            lines.append(f"  {_q(key[0])} -> {_q(key[1])} "
                         f"{_attrs(color='#adb5bd', style='dotted', tooltip=d.data)};")
        else:
            lag = _lag(g, d.src.op, d.dst.op)
            lines.append(f"  {_q(key[0])} -> {_q(key[1])} {style.version_attrs(d.data, lag)};")
    lines += _legend(style)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _lag(g: Graph, writer: str, reader: str) -> int:
    return next(e.lag for e in g.version_edges if e.writer == writer and e.reader == reader)


def to_dot(g: Graph, steps: int | None = None, chunks: dict[str, int] | None = None) -> str:
    """The step graph (``steps`` None) or ``steps`` unrolled steps, as DOT text."""
    if steps is None:
        return step_dot(g)
    if steps < 1:
        raise GraphError(f"steps must be at least 1, not {steps}")
    return unrolled_dot(unroll(g, steps, chunks))


def write(dot: str, path: str | Path) -> Path:
    """Write DOT text, or run Graphviz to make an SVG/PNG/PDF, chosen by the file's suffix."""
    p = Path(path)
    fmt = p.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise GraphError(f"the output must end in {', '.join('.' + f for f in FORMATS)}, "
                         f"not '{p.suffix or p.name}'", hint="e.g. -o graph.svg")
    if fmt == "dot":
        p.write_text(dot, encoding="utf-8")
        return p
    exe = shutil.which("dot")
    if exe is None:
        raise GraphError("Graphviz's 'dot' program is not installed, so no picture can be "
                         "drawn; write a .dot file instead",
                         hint="install graphviz (apt-get install graphviz), or use -o x.dot")
    try:
        subprocess.run([exe, f"-T{fmt}", "-o", str(p)], input=dot.encode("utf-8"),
                       check=True, capture_output=True, timeout=120)
    except subprocess.CalledProcessError as e:
        raise GraphError(f"dot failed: {e.stderr.decode(errors='replace').strip()}") from None
    except subprocess.TimeoutExpired:
        raise GraphError("dot took longer than 120 s; write a .dot file instead") from None
    except OSError as e:
        raise GraphError(f"cannot write '{p}': {e.strerror or e}") from None
    return p
