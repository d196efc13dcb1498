"""A run directory read back: its record, plan, pipeline, metrics, trace; ``rpeg show``'s text.

    >>> run = Run.open("runs/tiny_ppo-20261130-011500")                # doctest: +SKIP
    >>> print(summary(run))                                              # doctest: +SKIP
    run tiny_ppo-20261130-011500: ok, 60 of 60 steps, ...
    >>> write_plots(run)                                                 # doctest: +SKIP
    [PosixPath('.../plots/timeline.png'), PosixPath('.../plots/timeline.svg'), ...]

The record (``record.json``, see :mod:`rpeg.runtime.rundir.record`) carries the
hashes and the predicted and measured figures; this module adds what is read
from the other files when asked: the verification of the trace against the
plan, and the pictures (written into ``RUN_DIR/plots/``).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from rpeg.plan.model import Plan, device_ranges
from rpeg.runtime.rundir.record import load_run_cluster, read_record

PERFETTO = "https://ui.perfetto.dev"
MAX_TIMELINE_STEPS = 6


@attrs.frozen
class Run:
    path: Path
    record: dict
    plan: Plan
    pipeline: object
    cluster: object | None
    rows: tuple[dict, ...]
    damaged: tuple[tuple[int, str], ...] = ()     # metrics.jsonl lines left out, and why

    @classmethod
    def open(cls, path: str | Path) -> Run:
        from rpeg.runtime.rundir import files as rf
        from rpeg.runtime.rundir.directory import RunDir
        from rpeg.runtime.rundir.serial import loads, plan_from_json

        rd = RunDir.open(path)
        rows, damaged = rf.read_metrics(rd.path)
        return cls(rd.path.resolve(), read_record(rd.path),
                   rf.read_parsed(rd.path / "plan.json", "plan.json", plan_from_json),
                   rf.read_parsed(rd.path / "pipeline.json", "pipeline.json", loads),
                   load_run_cluster(rd.path), tuple(rows), tuple(damaged))

    @property
    def name(self) -> str:
        return self.path.name

    def trace_events(self) -> list[dict]:
        from rpeg.runtime.rundir import files as rf
        from rpeg.runtime.rundir.directory import events_from_trace
        return rf.read_parsed(self.path / "trace.json", "trace.json",
                              lambda text: events_from_trace(json.loads(text)))

    def measured_step_s(self) -> float | None:
        return self.record.get("measured", {}).get("step_time_s")

    def predicted_step_s(self) -> float | None:
        return self.record.get("predicted", {}).get("step_time_s")

    def predicted_memory(self) -> tuple[list[float], float]:
        pr = self.record.get("predicted", {})
        return list(pr.get("peak_memory", [])), float(pr.get("memory_capacity", 0.0))


def verification(run: Run):
    """The trace checked against the plan (a Report), or the error that stopped the check."""
    from rpeg.runtime.verify import verify_run
    try:
        return verify_run(run.path)
    except Exception as e:  # noqa: BLE001 — show must show the rest even when this fails
        return f"could not verify: {type(e).__name__}: {e}"


# --- pictures --------------------------------------------------------------------------------

def predicted_timeline(run: Run, steps: int):
    """The simulator's timeline of the run's plan over ``steps`` steps, or None."""
    if run.cluster is None or run.cluster.num_gpus < run.plan.num_devices:
        return None
    from rpeg.plan.evaluate import Evaluator
    ev = Evaluator(run.pipeline, run.cluster, steps=max(steps, 2))
    return ev.evaluate(run.plan, simulate_infeasible=True).timeline


def write_plots(run: Run, folder: str | Path | None = None) -> list[Path]:
    """timeline, memory and curves pictures (PNG + SVG) into ``RUN_DIR/plots``."""
    from rpeg.experiments import plots

    out = Path(folder) if folder else run.path / "plots"
    written: list[Path] = []
    steps = min(max(len(run.rows), 2), MAX_TIMELINE_STEPS)
    panels = []
    tl = predicted_timeline(run, steps)
    if tl is not None:
        from rpeg.plan.gantt import step_words
        panels.append((f"predicted by the plan's simulation on {run.cluster.name}: "
                       f"{step_words(run.predicted_step_s(), tl)}",
                       plots.bars_from_timeline(tl)))
    measured = run.measured_step_s()
    panels.append((f"measured (trace.json), first {steps} steps"
                   + (f": steady step {measured:.3g} s" if measured else ""),
                   plots.bars_from_trace(run.trace_events(), steps)))
    written += plots.timeline(panels, out / "timeline",
                              title=f"{run.pipeline.name}: predicted vs measured timeline "
                                    "(each panel on its own time scale)")
    peak, capacity = run.predicted_memory()
    if peak:
        pr = run.record["predicted"]
        written += plots.memory(peak, capacity, out / "memory",
                                title=f"{run.pipeline.name}: predicted peak memory per device "
                                      f"({pr.get('source', '')})",
                                kinds=pr.get("memory"), reserve=pr.get("memory_reserve", 0.0))
    evals = [{"step": e["step"], **{f"eval.{k}": e[k] for k in ("reward", "accuracy") if k in e}}
             for e in run.record.get("eval") or []]          # drawn at the step they follow
    written += plots.curves(list(run.rows) + evals, out / "curves",
                            title=f"{run.pipeline.name}: metrics per step"
                                  + (f" ({run.name})" if run.name != run.pipeline.name else ""),
                            predicted_step_s=run.predicted_step_s())
    return written


def _plain(m) -> dict:
    return attrs.asdict(m)


def plan_plots(plan: Plan, base: Path, pipeline=None, cluster=None) -> list[Path]:
    """Memory chart (and, with the pipeline and cluster, the Gantt chart) of a plan file."""
    from rpeg.experiments import plots

    written: list[Path] = []
    pr = plan.predicted
    if pipeline is not None and cluster is not None:
        from rpeg.plan.evaluate import Evaluator
        ev = Evaluator(pipeline, cluster, steps=6).evaluate(plan, simulate_infeasible=True)
        pr = ev.plan.predicted
        if ev.timeline is not None:
            from rpeg.plan.gantt import step_words
            words = step_words(pr.step_time_s, ev.timeline)
            written += plots.timeline([(f"simulated, {words}",
                                        plots.bars_from_timeline(ev.timeline))],
                                      base.with_name(base.name + "-gantt"),
                                      title=f"{plan.pipeline} on {plan.cluster}")
    if pr is not None and pr.peak_memory:
        written += plots.memory(list(pr.peak_memory), pr.memory_capacity,
                                base.with_name(base.name + "-memory"),
                                title=f"{plan.pipeline} on {plan.cluster}: predicted peak "
                                      "memory per device",
                                kinds=[_plain(m) for m in pr.memory],
                                reserve=pr.memory_reserve)
    return written


# --- text ---------------------------------------------------------------------------------------

def _history(path: Path) -> list[str]:
    """The run's resumes and re-plans (run.json), a line each: where it went on from and
    what it set aside; nothing for a run that ran in one go."""
    try:
        meta = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except OSError:
        return []
    except ValueError as e:               # the run's own record: damaged, said, not passed over
        return [f"  warning: run.json is not JSON ({e}); the status above is record.json's, "
                "as the run last wrote it"]
    if not isinstance(meta, dict):
        return ["  warning: run.json holds no JSON object; the status above is record.json's"]
    out = []
    for r in meta.get("resumes") or []:
        if not isinstance(r, dict):
            continue
        aside = [*(r.get("set_aside") or []), *(f"checkpoints/{d}" for d in
                                                (r.get("damaged_checkpoints") or []))]
        out.append(f"  resumed at step {r.get('from_step')} from "
                   f"{Path(str(r.get('checkpoint', '?'))).name}"
                   + (f", set aside: {', '.join(map(str, aside))}" if aside else ""))
    for r in meta.get("replans") or []:
        if isinstance(r, dict):
            out.append(f"  re-planned from step {r.get('from_step')}: {r.get('from_devices')} "
                       f"to {r.get('to_devices')} device(s) ({r.get('why')})")
    return out


def summary(run: Run, report=None, plots_written: list[Path] | None = None) -> str:
    """What ``rpeg show RUN_DIR`` prints."""
    rec, path = run.record, run.path
    meas = rec.get("measured", {})
    lines = [f"run {run.name}: {rec.get('status', 'unknown')}, {meas.get('steps_done', 0)} of "
             f"{rec.get('steps')} steps, started {rec.get('started')}, "
             f"{_s(meas.get('wall_s'))} wall ({_s(meas.get('setup_s'))} set-up)",
             f"  directory {path}"]
    if rec.get("error"):
        lines.append(f"  stopped by: {rec['error']}")
    lines += _history(path)
    lines += ["", f"record {rec.get('id', '?')}  (content hashes)"]
    lines += _inputs(rec.get("inputs", {}))
    lines += ["", "where: " + _where(rec.get("where", {}))]
    lines += _devices(run)
    lines += ["", *_step_time(rec), *_memory(rec)]
    final = rec.get("final", {})
    if final:
        n = min(len(run.rows), 5)
        lines += ["", f"final metrics (mean of the last {n} step{'s' if n != 1 else ''})"]
        lines += _columns([f"{k} {_num(v)}" for k, v in final.items()])
    evals = rec.get("eval") or []
    if evals:                                   # eval.jsonl: first and last evaluation
        keys = [k for k in evals[-1] if k in ("reward", "accuracy") or k.startswith("pass@")]
        lines += ["", f"evaluations ({len(evals)}, on {evals[-1].get('prompts')} held-out "
                      f"prompts x {evals[-1].get('samples')}; eval.jsonl)"]
        for e in (evals[0], evals[-1]) if len(evals) > 1 else evals:
            lines.append(f"  step {e.get('step')}: " + ", ".join(f"{k} {_num(e[k])}"
                                                                 for k in keys if k in e))
    if run.damaged:
        n, why = run.damaged[0]
        lines += ["", f"warning: metrics.jsonl line {n} is {why}; left out"
                  + (f" (and {len(run.damaged) - 1} more damaged lines)"
                     if len(run.damaged) > 1 else "")]
    lines += ["", "verification: " + (_head(str(report)) if report is not None else "not run "
                                      "(rpeg show RUN_DIR without --no-verify)")]
    lines += ["", "look at",
              f"  trace     {path / 'trace.json'}  (open in {PERFETTO} or chrome://tracing)",
              f"  metrics   {path / 'metrics.jsonl'}"]
    tb = rec.get("files", {}).get("tensorboard")
    if tb:
        lines.append(f"  tensorboard --logdir {path}")
    pics = plots_written or sorted((path / "plots").glob("*.png"))
    if pics:
        lines.append("  plots     " + ", ".join(str(p) for p in pics if p.suffix == ".png"))
    else:
        lines.append(f"  plots     rpeg show {path} --plots")
    return "\n".join(lines)


def _head(text: str, lines: int = 6) -> str:
    """The first lines of a long report, and how many more (rpeg verify prints them all)."""
    rows = text.splitlines()
    if len(rows) <= lines:
        return text
    return "\n".join(rows[:lines] + [f"  ... {len(rows) - lines} more (rpeg verify RUN_DIR "
                                      "lists them all)"])


def _inputs(inputs: dict) -> list[str]:
    out = []
    for key in ("spec", "pipeline", "plan", "cluster"):
        e = inputs.get(key)
        if not e:
            out.append(f"  {key:<9} (not recorded)")
            continue
        extra = ""
        if key == "plan":
            extra = f"  strategy {e.get('strategy')} for {e.get('cluster')}"
        if key == "cluster":
            extra = f"  {e.get('name')}: {e.get('devices')} x {e.get('gpu')}"
        if e.get("source"):
            extra += f"  (from {e['source']})"
        out.append(f"  {key:<9} {e.get('file', ''):<14} sha256 {str(e.get('sha256'))[:12]}{extra}")
    code = inputs.get("code", {})
    text = f"rpeg {code.get('rpeg', '?')}"
    if code.get("git_commit"):
        text += f", git {code['git_commit'][:12]}" + (" + uncommitted changes"
                                                     if code.get("git_dirty") else "")
    for pkg in ("torch", "distributed"):
        if pkg in code:
            text += f", {pkg} {code[pkg]}"
    out.append(f"  code      {text}")
    return out


def _where(where: dict) -> str:
    sched = where.get("scheduler", "local")
    return "a local Dask cluster on this machine" if sched == "local" else \
        f"the Dask scheduler at {sched}"


def _devices(run: Run) -> list[str]:
    workers = run.record.get("where", {}).get("workers", {})
    stages: dict[int, list[str]] = {}
    for p in run.plan.placements:
        for d in p.devices:
            stages.setdefault(d, []).append(p.stage)
    homes = {m: d for m, d in run.record.get("where", {}).get("homes", {}).items()}
    out = []
    for d in range(run.plan.num_devices):
        held = [m for m, devs in homes.items() if d in devs]
        text = f"  device {d}  {workers.get(str(d), '?'):<24} {', '.join(stages.get(d, [])) or '-'}"
        if held:
            text += f"  (weights of {', '.join(held)})"
        out.append(text)
    return out


def _step_time(rec: dict) -> list[str]:
    pr, me = rec.get("predicted", {}), rec.get("measured", {})
    p, m = pr.get("step_time_s"), me.get("step_time_s")
    ptext = f"{p:.3g} s ({pr.get('source')})" if p is not None else \
        f"none ({pr.get('error', 'no prediction')})"
    mtext = f"{m:.3g} s ({me.get('step_time_of')})" if m is not None else "none (no steps)"
    line = f"step time: predicted {ptext}, measured {mtext}"
    out = [line]
    if p and m:
        out.append(f"  measured / predicted = {m / p:.2f}x "
                   f"({'slower' if m > p else 'faster'} than predicted by {abs(m - p) / p:.0%})")
    if rt := me.get("response_tokens"):
        longest = f", longest {rt['longest']}" if "longest" in rt else ""
        out.append(f"  responses: {rt['mean']:.3g} tokens on average (steps {rt['steps']}"
                   f"{longest}), declared {rt['declared']:.3g} (workload gen_len)")
        if (q := pr.get("at_measured_lengths_s")) is not None:
            out.append(f"  the plan priced at the measured lengths: {q:.3g} s"
                       + (f"; measured / that = {m / q:.2f}x" if m else ""))
    if h := me.get("host"):
        out.append(f"  CPU per step (steps {h['from_step']}..{h['from_step'] + h['steps']}): "
                   f"ops {h['op_cpu_per_step_s']:.3g} s, device workers outside ops "
                   f"{h['worker_cpu_per_step_s']:.3g} s, client"
                   f"{' and scheduler' if rec.get('where', {}).get('scheduler', 'local') == 'local' else ''} "
                   f"{h['client_cpu_per_step_s']:.3g} s; {h['tasks_per_step']:.3g} Dask "
                   f"tasks a step")
    return out


def _memory(rec: dict) -> list[str]:
    pr = rec.get("predicted", {})
    peak, cap = pr.get("peak_memory"), pr.get("memory_capacity")
    if not peak:
        return []
    worst = max(range(len(peak)), key=lambda i: peak[i])
    groups = {}
    for i, v in enumerate(peak):
        groups.setdefault(v, []).append(i)
    text = f"peak memory (predicted): {_bytes(peak[worst])} on device {worst}"
    if cap:
        text += f" of {_bytes(cap)} ({peak[worst] / cap:.1%})"
    out = [text]
    if 1 < len(groups) <= 8:
        out += [f"  device{'s' if len(d) > 1 else ''} {device_ranges(tuple(d))}: {_bytes(v)}"
                for v, d in sorted(groups.items(), key=lambda x: x[1][0])]
    return out


def _columns(items: list[str], width: int = 3) -> list[str]:
    w = max(len(x) for x in items) + 3
    return ["  " + "".join(x.ljust(w) for x in items[i:i + width]).rstrip()
            for i in range(0, len(items), width)]


def _num(v: float) -> str:
    return f"{v:.4g}"


def _s(v) -> str:
    return "?" if v is None else f"{v:.1f} s"


def _bytes(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB"
