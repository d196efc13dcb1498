"""``rpeg graph FILE [--steps N] [--share] [--chunks STAGE=N] [-o graph.svg|.dot|.png]``.

    $ rpeg graph pipelines/ppo_llama8b.rpeg                     # the step graph as text
    $ rpeg graph pipelines/ppo_llama8b.rpeg --steps 3 -o ppo.svg
    wrote ppo.svg: 3 steps of ppo_llama8b, 24 op instances, 6 version edges

Without ``-o`` the graph is printed in its text form (the one golden tests
compare); with ``-o`` it is drawn with Graphviz, the format chosen by the suffix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rpeg.cli.output import suffix, writable, writing
from rpeg.errors import SpecError
from rpeg.graph import build, unroll, verify, verify_unrolled
from rpeg.graph.render import FORMATS, to_dot, write
from rpeg.graph.unroll import DepKind
from rpeg.spec import load
from rpeg.spec.model import OpKind


def parse_chunks(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        stage, _, n = item.partition("=")
        if not stage or not n.isdigit() or int(n) < 1:
            raise typer.BadParameter(f"must be STAGE=N with N >= 1 (e.g. rollout=4), not "
                                     f"'{item}'", param_hint="--chunks")
        out[stage] = int(n)
    return out


def register(app: typer.Typer) -> None:
    @app.command("graph")
    def graph_command(
        file: Path = typer.Argument(..., help="A pipeline (.rpeg)."),
        steps: int = typer.Option(0, "--steps", "-n", min=0, max=64,
                                  help="Unroll this many steps (0: the step graph)."),
        share: bool = typer.Option(False, "--share",
                                   help="Merge every 'share' group into one backbone."),
        chunks: list[str] = typer.Option([], "--chunks",
                                         help="Split a generate stage: STAGE=N (repeatable)."),
        output: Path = typer.Option(None, "--output", "-o",
                                    help="Write graph.svg, .png, .pdf or .dot."),
    ) -> None:
        """Show the RPEG graph: ops, data edges, parameter-version edges across steps."""
        output = writable(suffix(output, "-o", tuple(f".{f}" for f in FORMATS)), "-o")
        split = parse_chunks(chunks)
        if split and not steps:
            raise typer.BadParameter("needs --steps: chunks are in the unrolled graph",
                                     param_hint="--chunks")
        pipeline = load(file)
        g = verify(build(pipeline, share=share))
        batch = pipeline.workload.batch
        generate = [o.name for o in g.ops if o.kind is OpKind.GENERATE]
        for stage, n in split.items():
            if not g.has_op(stage):
                raise SpecError(f"--chunks names unknown stage '{stage}'",
                                hint="stages: " + ", ".join(o.name for o in g.ops))
            if stage not in generate:
                raise SpecError(f"--chunks must name a generate stage, not '{stage}'",
                                hint="generate stages: " + ", ".join(generate))
            if n > batch:
                raise SpecError(f"--chunks {stage}={n:,}: a step's {batch:,} responses "
                                f"split into at most {batch:,} chunks",
                                hint=f"--chunks {stage}={min(batch, 8)}")
        if output is None:
            if steps:
                print(verify_unrolled(unroll(g, steps, split)))
            else:
                print(g)
            return
        with writing(output, "the graph") as tmp:
            write(to_dot(g, steps or None, split), tmp)
        if steps:
            u = unroll(g, steps, split)
            versions = sum(1 for d in u.deps if d.kind is DepKind.VERSION)
            what = (f"{steps} steps of {g.name}, {len(u.instances)} op instances, "
                    f"{versions} version edges")
        else:
            what = f"{g.name}, {len(g.ops)} ops, {len(g.version_edges)} version edges"
        print(f"wrote {output}: {what}", file=sys.stderr)
