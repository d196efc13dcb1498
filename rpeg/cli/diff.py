"""``rpeg diff A B [--cluster CLUSTER.rpeg] [--json]``: what changed, and what it costs.

    $ rpeg diff pipelines/ppo_llama8b.rpeg pipelines/ppo_async.rpeg
    --- pipelines/ppo_llama8b.rpeg (ppo_llama8b)
    +++ pipelines/ppo_async.rpeg (ppo_async)
    staleness
      ~ rollout: 1 -> 2  (generation may read actor weights up to 2 updates old, was 1)
    ...

Like diff(1): nothing printed and exit 0 when A and B mean the same, exit 1 when
they differ, 2 when they cannot be compared. What A and B are decides the diff:
two specs (semantic, after ``extend``; with ``--cluster`` both are also compiled
and the predicted step time and memory compared), two plan files (``.json``),
or two run directories.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from rpeg.cli.compile import budget_of
from rpeg.errors import RpegError, SpecError
from rpeg.plan.options import MAX_SEED


def _kind(p: Path) -> str:
    if p.is_dir():
        return "run"
    if p.suffix == ".json":
        return "plan"
    return "spec"


def _predicted(pipeline, cluster, seed: int, budget: int) -> dict:
    """Compile one pipeline on the cluster; the figures the diff compares (or the error)."""
    from rpeg.plan import SearchOptions, Strategy, compile_plan
    try:
        plan = compile_plan(pipeline, cluster, Strategy.SEARCH,
                            SearchOptions(seed=seed, iterations=budget))
    except RpegError as e:
        return {"error": e.message}
    pred = plan.predicted
    if pred is None:
        return {"error": "the plan carries no prediction"}
    return {"step_time_s": pred.step_time_s,
            "peak_memory_bytes": max(pred.peak_memory, default=0.0),
            "peak_memory_per_device": [float(x) for x in pred.peak_memory],
            "layout": {pl.stage: list(pl.devices) for pl in plan.placements},
            "tokens_per_s": pred.tokens_per_s,
            "devices": len(sorted({d for p in plan.placements for d in p.devices}))}


def _bytes(x: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.0f} B"


def _delta_lines(cluster_name: str, a: dict, b: dict) -> list[str]:
    lines = [f"predicted on {cluster_name}"]
    if "error" in a and a == b:
        return lines + [f"  {a['error']}"]
    for side, d in (("A", a), ("B", b)):
        if "error" in d:
            lines.append(f"  {side}: no plan: {d['error']}")
    if "error" in a or "error" in b:
        return lines
    rows = (("step time", "step_time_s", lambda x: f"{x:.3g} s"),
            ("peak memory per GPU", "peak_memory_bytes", _bytes),
            ("throughput", "tokens_per_s", lambda x: f"{x:,.0f} tokens/s"),
            ("GPUs used", "devices", lambda x: f"{x}"))
    for label, key, show in rows:
        x, y = a[key], b[key]
        rel = f" ({(y - x) / x:+.1%})" if x else ""
        lines.append(f"  {label}: {show(x)} -> {show(y)}{rel}")
    return lines


def register(app: typer.Typer) -> None:
    @app.command("diff")
    def diff_command(
        a: Path = typer.Argument(..., help="The first spec (.rpeg), plan (.json) or run dir."),
        b: Path = typer.Argument(..., help="The second, of the same kind."),
        cluster: Path = typer.Option(None, "--cluster", "-c",
                                     help="Also compile both specs on this cluster and "
                                          "compare predicted step time and memory."),
        as_json: bool = typer.Option(False, "--json", help="Print the diff as JSON."),
        seed: int = typer.Option(None, "--seed", min=0, max=MAX_SEED,
                                 help="Seed of the plan search (with --cluster; default 0)."),
        budget: int = typer.Option(None, "--budget", callback=budget_of,
                                   help="Plans each walk of the search tries, per spec (with "
                                        f"--cluster; default {_default_budget()})."),
        force: bool = typer.Option(False, "--force", help="Two plans: compare a plan with a "
                                   "spec other than the one it was compiled from (a warning, "
                                   "not an error)."),
        spec: list[Path] = typer.Option(None, "--spec",
                                        help="Two plans: their spec, if not where a plan says "
                                             "(once for both, or twice: A's, then B's)."),
        plots: bool = typer.Option(False, "--plots", help="Two runs: write their curves side "
                                   "by side into B's plots/ (compare-A.png and .svg)."),
    ) -> None:
        """Show what changed between two specs, plans or runs (exit 1 if anything did)."""
        ka, kb = _kind(a), _kind(b)
        for p in (a, b):
            if not p.exists():
                raise SpecError(f"no such file or directory '{p}'")
        if ka != kb:
            print(f"rpeg diff: A is a {ka} and B is a {kb}; compare two specs, two plans "
                  "or two run directories", file=sys.stderr)
            raise typer.Exit(2)
        for given, name in ((seed, "--seed"), (budget, "--budget")):
            if given is not None and cluster is None:
                raise typer.BadParameter("plans the specs on a cluster: it goes with --cluster",
                                         param_hint=name)
        if cluster is not None and ka != "spec":
            raise typer.BadParameter(f"compiles two specs; two {ka}s carry their own "
                                     "predictions", param_hint="--cluster")
        seed = 0 if seed is None else seed
        budget = _default_budget() if budget is None else budget
        specs = list(spec or ())
        if specs and ka != "plan":
            raise typer.BadParameter(f"names the specs of two plans; two {ka}s carry their own",
                                     param_hint="--spec")
        if plots and ka != "run":
            raise typer.BadParameter(f"draws two runs' curves; two {ka}s have none",
                                     param_hint="--plots")
        if force and ka != "plan":
            raise typer.BadParameter(f"uses a plan with another spec; two {ka}s have no plan "
                                     "to check", param_hint="--force")
        if len(specs) > 2:
            raise typer.BadParameter("is given once (both plans' spec) or twice (A's, B's)",
                                     param_hint="--spec")
        if ka == "plan":
            _plan_diff(a, b, as_json, force, tuple(specs))
        if ka == "run":
            from rpeg.experiments import diff_runs
            result = diff_runs(a, b, plots_in_b=plots)
            _emit(result, as_json)
            raise typer.Exit(1 if getattr(result, "changed", bool(result)) else 0)
        _spec_diff(a, b, cluster, as_json, seed, budget)


def _plan_diff(a: Path, b: Path, as_json: bool, force: bool = False,
               specs: tuple[Path, ...] = ()) -> None:
    from rpeg.plan import diff_plans
    from rpeg.plan.validate import open_plan

    given = (specs * 2)[:2] if specs else (None, None)
    opened = [open_plan(p, spec=s, force=force) for p, s in zip((a, b), given, strict=True)]
    for p, o in zip((a, b), opened, strict=True):
        for w in o.warnings:
            print(f"{p}: warning: {w}", file=sys.stderr)
    plans = [o.plan for o in opened]
    result = diff_plans(plans[0], plans[1], str(a), str(b))
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    elif not result.same:
        print(result)
    raise typer.Exit(0 if result.same else 1)


def _emit(result, as_json: bool) -> None:
    if as_json:
        text = result.to_json() if hasattr(result, "to_json") else json.dumps(result, indent=2)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        text = result.text() if hasattr(result, "text") else str(result)
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _default_budget() -> int:
    from rpeg.plan.options import SearchOptions
    from rpeg.plan.space import Limits
    return SearchOptions(limits=Limits()).iterations


def _spec_diff(a: Path, b: Path, cluster: Path | None, as_json: bool, seed: int,
               budget: int) -> None:
    from rpeg.spec import FileKind, check_file, load_cluster
    from rpeg.spec.diff import diff, diff_clusters

    ca, cb = check_file(a), check_file(b)
    if ca.kind is not cb.kind:
        print(f"rpeg diff: A describes a {ca.kind.value} and B a {cb.kind.value}; compare two "
              "pipelines or two clusters", file=sys.stderr)
        raise typer.Exit(2)
    if ca.kind is FileKind.PROFILE:
        print("rpeg diff: compare the clusters that use these profiles", file=sys.stderr)
        raise typer.Exit(2)
    pa, pb = ca.value, cb.value
    d = diff(pa, pb) if ca.kind is FileKind.PIPELINE else diff_clusters(pa, pb)
    if ca.kind is FileKind.CLUSTER and cluster is not None:
        raise typer.BadParameter("compiles two pipelines on a cluster; two clusters are "
                                 "compared as they are", param_hint="--cluster")
    predicted = None
    if cluster is not None:
        c = load_cluster(cluster)
        if d.changed:
            predicted = {"cluster": c.name, "a": _predicted(pa, c, seed, budget),
                         "b": _predicted(pb, c, seed, budget)}
    if as_json:
        out = d.to_dict()
        if predicted is not None:
            out["predicted"] = predicted
        print(json.dumps(out, indent=2))
    elif d.changed:
        text = d.text()
        if predicted is not None:
            from rpeg.experiments.explain import cost_lines
            text += "\n".join(cost_lines(d, predicted) + _delta_lines(
                predicted["cluster"], predicted["a"], predicted["b"])) + "\n"
        sys.stdout.write(text)
    raise typer.Exit(1 if d.changed else 0)
