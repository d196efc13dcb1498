"""``rpeg show RUN_DIR|plan.json``: what a run did, or what a plan predicts, and its pictures.

    $ rpeg show runs/tiny_ppo-20261130-011500 --plots
    run tiny_ppo-20261130-011500: ok, 60 of 60 steps, started 2026-11-30T01:15:00Z, ...
    record 3bf6ffd3cf91  (content hashes)
      spec      spec.rpeg      sha256 7c6d7bb162e3  (from pipelines/tiny_ppo.rpeg)
      ...
    step time: predicted 0.054 s (cost model on local_cpu), measured 0.387 s (...)
    verification: verified 842 ops of 60 steps: placement, dependencies, versions - ok
    look at
      trace     runs/.../trace.json  (open in https://ui.perfetto.dev or chrome://tracing)
      plots     runs/.../plots/timeline.png, runs/.../plots/memory.png, runs/.../plots/curves.png

For a plan file: the plan's text form and prediction; ``--plots`` writes its
memory chart (and, when the plan names its spec and cluster, its Gantt chart)
beside it, as PLAN-memory.png/.svg and PLAN-gantt.png/.svg.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from rpeg.errors import RuntimeFailure


def register(app: typer.Typer) -> None:
    @app.command()
    def show(
        target: Path = typer.Argument(..., help="A run directory (rpeg run) or a plan (.json)."),
        plots: bool = typer.Option(False, "--plots", help="Write the pictures (PNG and SVG) "
                                   "into RUN_DIR/plots/ (or beside the plan)."),
        verify: bool = typer.Option(True, "--verify/--no-verify",
                                    help="Check the trace against the plan."),
        as_json: bool = typer.Option(False, "--json", help="Print the record as JSON."),
        force: bool = typer.Option(False, "--force", help="A plan whose spec changed since it "
                                   "was compiled: a warning, not an error."),
        spec: Path = typer.Option(None, "--spec", help="A plan's spec, if not where the plan "
                                  "says."),
    ) -> None:
        """Summarise a run: what ran where, predicted vs measured step time, final metrics."""
        if not target.exists():
            raise RuntimeFailure(f"'{target}' must be a run directory or a plan file, and it "
                                 "does not exist", hint="runs are written under runs/ by rpeg run")
        if target.is_file():
            _show_plan(target, plots, as_json, force, spec)
            return
        if spec is not None:
            raise typer.BadParameter("names a plan file's spec; a run directory holds its own",
                                     param_hint="--spec")
        if force:
            raise typer.BadParameter("uses a plan file with a changed spec; a run directory "
                                     "is checked against the spec it ran", param_hint="--force")
        from rpeg.experiments.runs import Run, summary, verification, write_plots

        run = Run.open(target)
        written = write_plots(run) if plots else None
        report = verification(run) if verify else None
        try:
            if as_json:
                out = dict(run.record)
                if report is not None:
                    out["verification"] = {"ok": getattr(report, "ok", False),
                                           "text": str(report)}
                out["pictures"] = [str(p) for p in written or []]
                text = json.dumps(out, indent=2)
            else:
                text = summary(run, report, written)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise RuntimeFailure(f"run record '{run.path / 'record.json'}' must hold what rpeg "
                                 f"run wrote, and it does not ({type(e).__name__}: {e})"[:400],
                                 hint="remove record.json: rpeg show builds it again from the "
                                      "run's files") from None
        print(text)
        if report is not None and not getattr(report, "ok", False):
            raise typer.Exit(1)


def _show_plan(path: Path, plots: bool, as_json: bool, force: bool = False,
               spec: Path | None = None) -> None:
    from rpeg.experiments.runs import plan_plots
    from rpeg.plan.validate import open_plan

    opened = open_plan(path, spec=spec, force=force)
    for w in opened.warnings:
        print(f"{path}: warning: {w}", file=sys.stderr)
    plan = opened.plan
    written = []
    if plots:
        from rpeg.destinations import check_outside_runs
        check_outside_runs(path.with_name(path.stem + "-memory.png"),
                           "--plots (pictures beside the plan)")
        pipeline, cluster = opened.pipeline, opened.cluster
        if cluster is None or cluster.num_gpus < plan.num_devices:
            pipeline = cluster = None
        written = plan_plots(plan, path.with_suffix(""), pipeline, cluster)
    if as_json:
        out = plan.to_dict()
        out["pictures"] = [str(p) for p in written]
        print(json.dumps(out, indent=2))
        return
    print(plan)
    for p in written:
        if p.suffix == ".png":
            print(f"wrote {p} (and .svg)")

