"""``rpeg simulate plan.json``: replay a plan in the event-driven simulator and draw it.

    $ rpeg simulate plan.json --steps 8 -o gantt.png
    ppo_llama8b on gh200_64: 8 steps simulated, predicted step 12.70 s
      GPUs 0-19      busy  97%   idle 0.38 s per step
      ...
    wrote gantt.png

The plan names the spec and cluster it was compiled from (``--spec`` and
``--cluster`` override them) and is checked against them as every command checks
a plan (``rpeg.plan.validate``); op times come from the cost model again, so a plan
edited by hand is priced as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from rpeg.cli.output import suffix, writable, writing

PICTURES = (".png", ".svg", ".pdf")          # what the Gantt picture is drawn as
# steps a simulation may be asked for: far past any steady state (a plan's steady state is
# measured within 2 (k + 1) + 3 + (k + 1) steps at staleness k), and bounded in time and memory
MAX_SIMULATED = 1000


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        plan_file: Path = typer.Argument(..., metavar="PLAN.json", help="A plan from rpeg compile."),
        steps: int = typer.Option(8, "--steps", min=2, max=MAX_SIMULATED,
                                  help="Steps to simulate."),
        output: Path = typer.Option(None, "-o", "--output",
                                    help="Gantt picture (.png, .svg or .pdf)."),
        spec: Path = typer.Option(None, "--spec", help="The pipeline, if not where the plan "
                                                       "says."),
        cluster: Path = typer.Option(None, "--cluster", help="The cluster, if not where the "
                                                             "plan says."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        force: bool = typer.Option(False, "--force", help="Use the plan with a spec other "
                                   "than the one it was compiled from (a warning, not an "
                                   "error)."),
    ) -> None:
        """Simulate a plan step by step; print the step time and idle time per GPU group."""
        from rpeg.plan.evaluate import Evaluator
        from rpeg.plan.gantt import step_words
        from rpeg.plan.model import device_ranges
        from rpeg.plan.validate import open_plan

        output = writable(suffix(output, "-o", PICTURES), "-o")
        opened = open_plan(plan_file, spec=spec, cluster=cluster, need_cluster=True, exact_devices=True, force=force)
        for w in opened.warnings:
            print(f"{plan_file}: warning: {w}", file=sys.stderr)
        plan, pipeline, machine = opened.plan, opened.pipeline, opened.cluster
        result = Evaluator(pipeline, machine, steps=steps).evaluate(plan,
                                                                     simulate_infeasible=True)
        tl = result.timeline
        if output is not None:
            from rpeg.plan.gantt import draw
            with writing(output, "the Gantt picture") as tmp:
                draw(tl, tmp, title=f"{plan.pipeline} on {plan.cluster}",
                     step_s=result.step_time_s)
        bubbles = tl.bubbles()
        if as_json:
            print(json.dumps({
                "step_time_s": result.plan.predicted.step_time_s,
                "ops_step_time_s": tl.step_time_s, "steps": steps, "fits": result.feasible,
                "step_ends": list(tl.step_ends),
                "groups": [{"devices": list(g), "idle_s_per_step": b} for g, b in bubbles],
                "events": [{"op": e.instance.op, "step": e.instance.step,
                            "chunk": e.instance.chunk, "start": e.start, "end": e.end,
                            "devices": device_ranges(e.devices)} for e in tl.events],
                "gantt": str(output) if output else None}, indent=2))
            return
        print(f"{plan.pipeline} on {plan.cluster}: {steps} steps simulated, "
              f"{step_words(result.plan.predicted.step_time_s, tl)}")
        busy = tl.busy()
        for g, idle in bubbles:
            print(f"  GPUs {device_ranges(g):<12} busy {100 * busy[list(g)].mean():3.0f}%   "
                  f"idle {idle:.3f} s per step")
        if not result.feasible:
            sf = result.shortfall
            print(f"warning: this plan does not fit: GPU {sf.device} needs "
                  f"{sf.need / 1e9:.1f} GB of {sf.capacity / 1e9:.0f} GB")
        if output is not None:
            print(f"wrote {output}")

