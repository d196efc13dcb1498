"""``rpeg compile FILE.rpeg --cluster CLUSTER.rpeg``: plan a pipeline on a cluster.

    $ rpeg compile pipelines/ppo_llama8b.rpeg --cluster pipelines/clusters/gh200_64.rpeg
    ppo_llama8b on gh200_64 (64 GPUs): strategy search, seed 0, planned in 4.1 s
    predicted step time 9.87 s, 27530 generated tokens/s
    speedup 1.34x over colocated (13.24 s), 1.43x over split (14.09 s), 1.19x over realloc ...
    ...
    wrote plan.json and plan.png

Exit status 0 with a plan; 1 when the input is wrong or nothing fits (the message
says which model and op is short of how much memory, and what would help).

The search's budget is a count of proposals (``--budget``), so the same spec, cluster,
seed and budget give the same plan.json on any machine; the plan records its search
options, and ``rpeg compile plan.json`` compiles it again from them and says whether the
same plan came out (exit 1 if not).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import json
from pathlib import Path

import attrs
import typer

from rpeg.cli.output import writable, writing
from rpeg.plan.model import Strategy, device_ranges, si
from rpeg.plan.options import MAX_ITERATIONS, MAX_SEED


class Compiled(enum.Enum):
    """The strategies ``rpeg compile`` offers: the search, a baseline, or the spec's pinned
    layouts priced as written (a plan written by hand is one you give ``rpeg run`` or
    ``rpeg simulate``, not one it compiles)."""

    SEARCH = "search"
    COLOCATED = "colocated"
    SPLIT = "split"
    REALLOC = "realloc"
    PINNED = "pinned"


def register(app: typer.Typer) -> None:
    defaults = _defaults()

    @app.command()
    def compile(
        spec: Path = typer.Argument(..., help="The pipeline (.rpeg), or a plan (.json) to "
                                              "compile again from the options it records."),
        cluster: Path = typer.Option(None, "--cluster", "-c",
                                     help="The cluster (.rpeg); for a plan, instead of the "
                                          "one it names."),
        output: Path = typer.Option(None, "-o", "--output",
                                    help="Where to write the plan (a Gantt PNG goes beside it); "
                                         "default plan.json in the current directory; for a "
                                         "plan, nothing."),
        strategy: Compiled = typer.Option(Compiled.SEARCH, "--strategy", case_sensitive=False,
                                          help="search, a baseline (colocated, split, "
                                               "realloc), or pinned: the spec's `place` "
                                               "layouts priced as written."),
        seed: int = typer.Option(defaults.seed, "--seed", min=0, max=MAX_SEED,
                                 help="Seed of the search."),
        budget: int = typer.Option(defaults.iterations, "--budget", "--iterations",
                                   callback=budget_of,
                                   help="Plans each walk of the search tries (the search's "
                                        "budget: the same budget and seed give the same "
                                        f"plan), 1 to {MAX_ITERATIONS:,}."),
        patience: int = typer.Option(defaults.patience, "--patience", min=0,
                                     help="Proposals a walk makes without bettering its "
                                          "best plan by 0.1% before it stops (0: it walks "
                                          "its whole budget); more finds a little more, "
                                          "slower."),
        time_cap: float = typer.Option(defaults.time_cap_s, "--time-cap", min=0.0,
                                       help="Safety cap on the search's wall-clock seconds; a "
                                            "search it stops says so, in the output and the "
                                            "plan."),
        carry: bool = typer.Option(True, "--carry/--no-carry",
                                   help="Let generation carry unfinished responses into later "
                                        "steps where the staleness bound allows (partial "
                                        "rollouts)."),
        runnable: bool = typer.Option(False, "--runnable",
                                      help="Plan only what `rpeg run` executes (the "
                                           "default; kept for scripts)."),
        any_executor: bool = typer.Option(False, "--any-executor",
                                          help="Plan for an executor with everything the cost "
                                               "model prices, which `rpeg run` may not "
                                               "execute (the output says what it lacks)."),
        memory_reserve: str = typer.Option(None, "--memory-reserve",
                                           help="Share of each GPU's memory plans leave free "
                                                "(10% or 0.1; default: the profile's reserve, "
                                                "10% unless it says)."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        no_gantt: bool = typer.Option(False, "--no-gantt", help="Skip the Gantt picture."),
    ) -> None:
        """Find the fastest plan that fits in memory; print it, write plan.json and a Gantt PNG.

        Given a plan.json instead of a spec, compile again with the spec, cluster, strategy
        and search options the plan records, and say whether the same plan came out
        (exit 1 if not)."""
        from rpeg.cost.memory import with_reserve
        from rpeg.plan.compile import compile_report
        from rpeg.plan.options import SearchOptions
        from rpeg.plan.space import Limits
        from rpeg.spec import load, load_cluster
        from rpeg.spec.inputs import files_read

        output = writable(output, "-o")                  # before the search, not after it
        if spec.suffix == ".json":
            given = {"--strategy": strategy is not Compiled.SEARCH,
                     "--seed": seed != defaults.seed, "--budget": budget != defaults.iterations,
                     "--patience": patience != defaults.patience,
                     "--time-cap": time_cap != defaults.time_cap_s, "--no-carry": not carry,
                     "--runnable": runnable, "--any-executor": any_executor,
                     "--memory-reserve": memory_reserve is not None}
            for flag, set_ in given.items():
                if set_:
                    raise typer.BadParameter("a plan is compiled again with the options it "
                                             "records; compile its spec to choose others",
                                             param_hint=flag)
            _remake(spec, cluster, output, as_json, no_gantt)
            return
        if cluster is None:
            raise typer.BadParameter("is required to compile a spec", param_hint="--cluster")
        if runnable and any_executor:
            raise typer.BadParameter("plans for rpeg's runtime; it cannot go with "
                                     "--any-executor", param_hint="--runnable")
        output = writable(output or Path("plan.json"), "-o")
        if not no_gantt:
            writable(output.with_suffix(".png"), "-o (its Gantt picture beside it)")
        pipeline = load(spec)
        machine = with_reserve(load_cluster(cluster), reserve_of(memory_reserve))
        _not_over_inputs(output, no_gantt, files_read(pipeline, machine))
        # rpeg's runtime as its backends declare it: the same on every machine that plans
        limits = Limits() if any_executor else Limits.runtime()
        if not carry:
            limits = attrs.evolve(limits, carry_engines=frozenset())
        opts = SearchOptions(seed=seed, iterations=budget, patience=patience,
                             time_cap_s=time_cap, limits=limits)
        with _collector_paused():
            report = compile_report(pipeline, machine, Strategy(strategy.value), opts)
        _write(report, pipeline, machine, output, as_json, no_gantt, any_executor)


def _not_over_inputs(output: Path, no_gantt: bool, reads: tuple[Path, ...]) -> None:
    """RpegError (exit 1) when the plan, or its Gantt picture beside it, would be written
    over a file the command read: the spec, a base it extends, its dataset, a reward's
    module, the cluster or its profile (checked once they are known, before the search)."""
    writable(output, "-o", reads)
    if not no_gantt:
        writable(output.with_suffix(".png"), "-o (its Gantt picture beside it)", reads)


def budget_of(value: int | None) -> int | None:
    """``--budget``: a count of proposals a walk, 1 to ``MAX_ITERATIONS`` (None: unset)."""
    if value is not None and not 1 <= value <= MAX_ITERATIONS:
        raise typer.BadParameter(
            f"must be a count of proposals a walk from 1 to {MAX_ITERATIONS:,}, not "
            f"{value:,}; the default, {_defaults().iterations:,}, plans the shipped "
            "pipelines, and a search remembers every plan it proposes, so its memory grows "
            "with the budget", param_hint="--budget")
    return value


def reserve_of(text: str | None) -> float | None:
    """``--memory-reserve``'s share: ``10%`` or ``0.1`` (None: the cluster's own)."""
    if text is None:
        return None
    t = text.strip()
    try:
        x = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        x = -1.0
    if not 0 <= x < 1:
        raise typer.BadParameter(f"must be a share from 0% up to below 100%, such as 10% or "
                                 f"0.1, not '{text}'", param_hint="--memory-reserve")
    return x


def _defaults():
    """The search's defaults (rpeg.plan.options), without asking the backends."""
    from rpeg.plan.options import SearchOptions
    from rpeg.plan.space import Limits
    return SearchOptions(limits=Limits())


def _write(report, pipeline, machine, output: Path | None, as_json: bool, no_gantt: bool,
           any_executor: bool, extra: list[str] | None = None) -> None:
    """Write the plan (and its Gantt picture) where asked; print the summary."""
    gantt = None
    if output is not None:
        with writing(output, "the plan") as tmp:
            report.plan.save(tmp)
        if not no_gantt and report.evaluation.timeline is not None:
            from rpeg.plan.gantt import draw
            gantt = output.with_suffix(".png")
            with writing(gantt, "the Gantt picture") as tmp:
                draw(report.evaluation.timeline, tmp, title=f"{pipeline.name} on {machine.name}",
                     step_s=report.plan.predicted.step_time_s)
    if as_json:
        print(json.dumps(summary_json(report, output, gantt, any_executor), indent=2))
    else:
        print("\n".join([summary_text(report, machine, output, gantt, pipeline, any_executor)]
                        + (extra or [])))


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a plan is searched for, as it was
    after. A search makes millions of small objects, keeps many in its memos and leaves
    almost none in cycles: the collector's passes over them (a full one walks every object
    kept) cost about a fifth of a compile's CPU and free next to nothing (a few thousand
    objects a compile), which reference counting frees alike without it. What it made is
    then frozen (:func:`gc.freeze`) before the collector runs again: its first pass would
    otherwise walk every object made since it paused, as one full pass."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.enable()


def _remake(path: Path, cluster: Path | None, output: Path | None, as_json: bool,
            no_gantt: bool) -> None:
    """``rpeg compile PLAN.json``: the plan made again from what it records, compared."""
    from rpeg.plan.compile import recompile
    from rpeg.plan.diff import diff_plans
    from rpeg.plan.model import Plan
    from rpeg.plan.space import Limits
    from rpeg.spec import load, load_cluster

    old = Plan.load(path)
    from rpeg.plan.validate import plan_spec, recorded_file
    from rpeg.spec.inputs import files_read
    pipeline = load(plan_spec(old, path))
    machine = load_cluster(cluster or recorded_file(old.cluster_path, path))
    _not_over_inputs(output or Path("plan.json"), no_gantt,      # before the search
                     (path, *files_read(pipeline, machine)))
    with _collector_paused():
        report = recompile(old, str(path), cluster)
    same = report.plan.to_json() == old.to_json()
    lines = [f"the same plan as {path}" if same else f"not the same plan as {path}"]
    if not same:
        d = diff_plans(old, report.plan, str(path), "now")
        if not d.same:
            lines.append(str(d))
        if old.rpeg_version != report.plan.rpeg_version:
            lines.append(f"  rpeg {old.rpeg_version} made it, this is rpeg "
                         f"{report.plan.rpeg_version}")
        if old.spec_hash != report.plan.spec_hash:
            lines.append(f"  the spec {old.spec_path} changed since")
        if old.search is not None and old.search.time_capped:
            lines.append("  the search that made it was stopped by its time cap")
    any_executor = old.search is not None and old.search.options.limits == Limits()
    _write(report, pipeline, machine, output, as_json, no_gantt, any_executor,
           extra=["", *lines])
    if not same:
        raise typer.Exit(1)


def summary_json(report, output: Path, gantt: Path | None, any_executor: bool = False) -> dict:
    out = report.plan.to_dict()
    out["executor"] = "any" if any_executor else "rpeg"
    out["runnable"] = not_runnable(report.plan) is None
    out["baselines"] = {s.value: (e.step_time_s if e else None) for s, e in report.baselines}
    out["speedup"] = {s.value: report.speedup(s) for s, _ in report.baselines}
    out["planning_s"] = report.seconds
    out["files"] = {"plan": str(output) if output else None,
                    "gantt": str(gantt) if gantt else None}
    return out


def summary_text(report, cluster, output: Path, gantt: Path | None, pipeline,
                 any_executor: bool = False) -> str:
    plan, pr = report.plan, report.plan.predicted
    lines = [f"{plan.pipeline} on {plan.cluster} ({plan.num_devices} GPUs): strategy "
             f"{plan.strategy.value}, seed {plan.seed}, planned in {report.seconds:.1f} s",
             f"predicted step time {seconds(pr.step_time_s)} s, {pr.tokens_per_s:.0f} generated "
             f"tokens/s"]
    lines += checkpoint_lines(pr, pipeline)
    lines += control_lines(pr, cluster)
    if plan.search is not None and plan.search.time_capped:
        lines.append(f"note: the search stopped at its {plan.search.options.time_cap_s:g} s time "
                     f"cap after {plan.search.proposals} proposals, before its budget of "
                     f"{plan.search.options.iterations} a walk: this plan depends on this "
                     f"machine's speed and load (raise --time-cap, or lower --budget)")
    speed = []
    for s, ev in report.baselines:
        if ev is None:
            speed.append(f"no {s.value} plan fits")
        elif s is not plan.strategy:
            speed.append(f"{report.speedup(s):.2f}x over {s.value} ({seconds(ev.step_time_s)} s)")
    if speed:
        lines.append("speedup " + ", ".join(speed))
    lines += ["", "placement"]
    rows = [("stage", "GPUs", "dp", "tp", "pp", "micro-batches", "zero", "chunks", "engine",
             "seconds")]
    times = dict(pr.op_times)
    from rpeg.plan.structure import plan_graph
    op_of = {s: o.name for o in plan_graph(pipeline, plan).ops for s in o.stages}
    ran_on = {u.stage: u.devices for u in pr.ops}
    for p in plan.placements:
        t = times.get(op_of.get(p.stage), 0.0)
        where = device_ranges(p.devices)
        if 0 < ran_on.get(op_of.get(p.stage), len(p.devices)) < len(p.devices):
            # one call over the whole batch (a group estimator), on the first block
            where += f" (one call, on {device_ranges(p.devices[:len(p.devices) // p.dp])})"
        rows.append((p.stage, where, str(p.dp), str(p.tp), str(p.pp),
                     f"{p.microbatches}" + (" +recompute" if p.recompute else ""), str(p.zero),
                     str(p.chunks), p.engine.value, f"{t:.2f}"))
    lines += _table(rows)
    lines += conversation_lines(plan, pipeline, cluster)
    lines += ["", "ops per step (FLOPs and bytes over their GPUs; MFU, MBU: the share of the "
                  "GPUs' peak compute and memory bandwidth they use)"]
    lines += _table(op_rows(pr))
    lines += ["", memory_title(pr)]
    lines += _table(memory_rows(pr))
    lines += ["", "structure"]
    from rpeg.plan.staleness import describe
    lines.append(f"  staleness: {describe(pipeline, plan)}")
    lines.append("  sharing: " + ("; ".join(" + ".join(g) for g in plan.shared)
                                  or "none (separate backbones)"))
    lines.append("  fusion: " + ("; ".join(" + ".join(g) for g in plan.fusion) or "none"))
    chunks = _streaming(pipeline, plan)
    lines.append("  streaming: " + (", ".join(chunks) or "none (whole batches)"))
    if output is not None:
        lines += ["", f"wrote {output}" + (f" and {gantt}" if gantt else "")]
    if any_executor:
        why = not_runnable(plan)
        lines.append("note: planned for any executor (--any-executor): everything the cost "
                     "model prices, " + (f"and `rpeg run` cannot execute this plan ({why})"
                                         if why else "and `rpeg run` executes this plan too"))
    return "\n".join(lines)


def checkpoint_lines(pr, pipeline) -> list[str]:
    """The checkpoints' part of the predicted step (``rpeg.cost.checkpoint``), at the
    workload's ``checkpoint_every``."""
    from rpeg.cost.checkpoint import CHECKPOINT_OP, cadence, cuts, per_step
    one = dict(pr.op_times).get(CHECKPOINT_OP, 0.0)
    if not one:
        return []
    steps, every_n, every = cadence(pipeline)
    part = per_step(one, steps, every_n, every)
    at = ([f"every {every_n}"] if every_n else []) + (["every eval"] if every else [])
    at = f"{', '.join(at)} and the last" if at else "only the last"
    return [f"  of which {seconds(part)} s ({100 * part / pr.step_time_s:.1f}%) is checkpoints: "
            f"{cuts(steps, every_n, every)} in {steps} steps ({at}), {seconds(one)} s each"]


def seconds(x: float) -> str:
    """A time in seconds to read: two decimals from a second up, three significant digits
    below (a CPU plan's 0.0712 s, not 0.07 s).

        >>> seconds(9.874), seconds(0.07123), seconds(0.000451)
        ('9.87', '0.0712', '0.000451')
    """
    return f"{x:.2f}" if x >= 0.995 else f"{x:.3g}"


def control_lines(pr, cluster) -> list[str]:
    """The control plane's part of the predicted step, and a note where it is too large."""
    from rpeg.cost.control import share, terms_of, verdict
    if not pr.control_s:
        return []
    where = ("CPU on the devices' cores" if cluster.gpu.host_cores > 0 else
             f"time in its client and Dask scheduler (terms of the {terms_of(cluster.gpu)[1]} "
             "profile)")
    lines = [f"  of which {seconds(pr.control_s)} s ({100 * share(pr.control_s, pr.step_time_s):.1f}%)"
             f" is the control plane's {where}: {pr.tasks_per_step:,} Dask tasks a step"]
    why = verdict(pr.control_s, pr.step_time_s, pr.tasks_per_step, cluster.num_gpus)
    return lines + ([f"note: {why}"] if why else [])


def conversation_lines(plan, pipeline, cluster) -> list[str]:
    """Per generate stage with tools, each turn's predicted generation and tool time in a
    step, as the plan's generate op is priced (``rpeg.cost.turns``)."""
    from rpeg.cost.topology import Topology
    from rpeg.cost.turns import carries, rounds
    from rpeg.plan.evaluate import Evaluator
    ev = None
    lines: list[str] = []
    for work in _conversation_works(pipeline):
        if ev is None:
            ev = Evaluator(pipeline, cluster)
            row_of = ev.rows_of(plan, ev.graph(plan))
        p = plan.placement(work.stage)
        par = p.layout
        rs, _ = rounds(work, par, p.devices, Topology.from_cluster(cluster), cluster,
                       work.workload.batch, p.engine, row_of.get(work.stage), ev.cap(p))
        conv = work.conversation
        c = carries(work, ev.cap(p))
        lines += ["", f"conversations: {work.stage} (up to {conv.max_turns} turns, "
                      f"{', '.join(conv.declared)}"
                      + (f"; {c + 1} cohorts a round, carried between turns" if c else "")
                      + ")"]
        rows = [("turn", "samples", "generation s", "tool calls", "tools s")]
        for r in rs:
            rows.append((str(r.turn), f"{r.rows:.0f}", f"{r.generate_s:.3f}", f"{r.calls:.0f}",
                         f"{r.tools_s:.3f}"))
        rows.append(("all", "", f"{sum(r.generate_s for r in rs):.3f}",
                     f"{sum(r.calls for r in rs):.0f}", f"{sum(r.tools_s for r in rs):.3f}"))
        lines += _table(rows)
    return lines


def _conversation_works(pipeline):
    from rpeg.graph.work import work_of
    from rpeg.spec.model import OpKind
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            w = work_of(pipeline, s.name)
            if w.conversation is not None:
                yield w


def not_runnable(plan) -> str | None:
    """Why rpeg's own runtime (as declared, wherever it runs) would refuse ``plan``, or None."""
    from rpeg.errors import PlanError
    from rpeg.plan.compile import check_executable
    from rpeg.plan.space import Limits
    try:
        check_executable(plan, Limits.runtime())
    except PlanError as e:
        return e.message
    return None


def op_rows(pr) -> list[tuple[str, ...]]:
    """The per-op table: FLOPs, bytes, time, MFU, MBU."""
    rows = [("op", "GPUs", "FLOPs", "bytes moved", "seconds", "MFU", "MBU")]
    for u in pr.ops:
        rows.append((u.stage, str(u.devices), si(u.flops, "FLOP"), si(u.bytes, "B"),
                     f"{u.time_s:.3g}", f"{100 * u.mfu:.0f}%", f"{100 * u.mbu:.0f}%"))
    return rows



def memory_title(pr) -> str:
    cap, reserve = pr.memory_capacity, pr.memory_reserve
    return (f"memory per GPU, GB, at its peak (usable {(cap - reserve) / 1e9:.1f} GB: "
            f"{cap / 1e9:.3g} GB less a {100 * reserve / cap:.0f}% reserve)") if cap else \
        "memory per GPU, GB, at its peak"


def memory_rows(pr) -> list[tuple[str, ...]]:
    """The peak of each group of GPUs alike, by kind, with how busy they are."""
    rows = [("GPUs", "weights", "grads", "optimizer", "activations", "KV cache", "buffers",
             "total", "used", "busy", "peak in")]
    usable = pr.memory_capacity - pr.memory_reserve
    for m in pr.memory:
        busy = sum(pr.busy[d] if d < len(pr.busy) else 0.0 for d in m.devices) \
            / len(m.devices)
        rows.append((device_ranges(m.devices), *(f"{getattr(m, k) / 1e9:.1f}" for k in (
            "weights", "grads", "optimizer", "activations", "kv_cache", "buffers")),
            f"{m.total / 1e9:.1f}", f"{100 * m.total / usable:.0f}%" if usable else "",
            f"{100 * busy:.0f}%", m.op or "-"))
    return rows


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _streaming(pipeline, plan) -> list[str]:
    """Each generate stage streaming its responses in more than one chunk a block, as the
    runtime streams them (:func:`rpeg.plan.oplayout.stream_chunks`: the chunks asked, rounded
    up to as many on each block; fewer than its blocks are one a block, whole batches)."""
    from rpeg.graph.deal import deal_group
    from rpeg.graph.work import work_of
    from rpeg.plan.oplayout import blocks_of, stream_chunks
    from rpeg.spec.model import OpKind
    responses = pipeline.workload.prompts * pipeline.workload.samples
    out = []
    for s in pipeline.stages:
        if s.kind is not OpKind.GENERATE:
            continue
        p = plan.placement(s.name)
        blocks = blocks_of(p)
        group = deal_group(work_of(pipeline, s.name))
        rounds = stream_chunks(p.chunks, blocks, responses, group) // blocks
        if rounds > 1:
            out.append(f"{s.name} in {rounds} chunks" + (f" on each of its {blocks} blocks"
                                                         if blocks > 1 else ""))
    return out
