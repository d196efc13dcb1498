"""``rpeg simulate plan.json``: replay a plan in the event-driven simulator and draw it.

    $ rpeg simulate plan.json --steps 8 -o gantt.png
    ppo_llama8b on gh200_64: 8 steps simulated, steady-state step 12.70 s
      GPUs 0-19      busy  97%   idle 0.38 s per step
      ...
    wrote gantt.png

The plan names the spec and cluster it was compiled from (``--spec`` and
``--cluster`` override them); op times come from the cost model again, so a plan
edited by hand is priced as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rpeg.cli.output import suffix, writable, writing

PICTURES = (".png", ".svg", ".pdf")          # what the Gantt picture is drawn as


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        plan_file: Path = typer.Argument(..., metavar="PLAN.json", help="A plan from rpeg compile."),
        steps: int = typer.Option(8, "--steps", min=2, help="Steps to simulate."),
        output: Path = typer.Option(None, "-o", "--output",
                                    help="Gantt picture (.png, .svg or .pdf)."),
        spec: Path = typer.Option(None, "--spec", help="The pipeline, if not where the plan "
                                                       "says."),
        cluster: Path = typer.Option(None, "--cluster", help="The cluster, if not where the "
                                                             "plan says."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Simulate a plan step by step; print the step time and idle time per GPU group."""
        from rpeg.errors import PlanError, Span
        from rpeg.plan.evaluate import Evaluator
        from rpeg.plan.model import Plan, device_ranges
        from rpeg.spec import load, load_cluster

        output = suffix(writable(output, "-o"), "-o", PICTURES)
        plan = Plan.load(plan_file)
        spec_path = spec or _near(plan.spec_path, plan_file)
        cluster_path = cluster or _near(plan.cluster_path, plan_file)
        if spec_path is None or cluster_path is None:
            raise PlanError("plan must name its spec and cluster files, not leave them out",
                            Span(str(plan_file), 0, 0),
                            hint="pass --spec FILE.rpeg --cluster CLUSTER.rpeg")
        pipeline, machine = load(spec_path), load_cluster(cluster_path)
        if pipeline.name != plan.pipeline or machine.num_gpus != plan.num_devices:
            raise PlanError(f"plan must be for pipeline '{pipeline.name}' on {machine.num_gpus} "
                            f"GPUs, not '{plan.pipeline}' on {plan.num_devices}",
                            Span(str(plan_file), 0, 0), hint="recompile the plan")
        result = Evaluator(pipeline, machine, steps=steps).evaluate(plan,
                                                                     simulate_infeasible=True)
        tl = result.timeline
        if output is not None:
            from rpeg.plan.gantt import draw
            with writing(output, "the Gantt picture"):
                draw(tl, output, title=f"{plan.pipeline} on {plan.cluster}")
        bubbles = tl.bubbles()
        if as_json:
            print(json.dumps({
                "step_time_s": tl.step_time_s, "steps": steps, "fits": result.feasible,
                "step_ends": list(tl.step_ends),
                "groups": [{"devices": list(g), "idle_s_per_step": b} for g, b in bubbles],
                "events": [{"op": e.instance.op, "step": e.instance.step,
                            "chunk": e.instance.chunk, "start": e.start, "end": e.end,
                            "devices": device_ranges(e.devices)} for e in tl.events],
                "gantt": str(output) if output else None}, indent=2))
            return
        print(f"{plan.pipeline} on {plan.cluster}: {steps} steps simulated, steady-state step "
              f"{tl.step_time_s:.3f} s")
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


def _near(recorded: str, plan_file: Path) -> Path | None:
    """The recorded path as written, or beside the plan file."""
    if not recorded:
        return None
    p = Path(recorded)
    if p.exists():
        return p
    beside = plan_file.parent / p.name
    return beside if beside.exists() else p
