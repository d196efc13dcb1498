"""``rpeg run --resume RUN_DIR [--steps N]``: continue a run directory from its last
complete checkpoint, or extend a finished run to more steps.

    >>> resume_run("runs/tiny_ppo-20261130-011500")                    # doctest: +SKIP
    >>> resume_run("runs/tiny_ppo-20261130-011500", steps=120)         # a 60-step run, extended

Everything the resume reads is checked before anything in the directory is changed:
run.json's fields, the pipeline and the plan (against each other, as every command
checks a plan), the checkpoint (manifest, state, safetensors headers), the metrics and
the event log up to the checkpoint. A damaged record refuses the resume with the file
and what is wrong, and leaves the directory as it was. The directory is locked for the
whole resume, like a run.

Extending (``--steps N`` past the steps the run was made with) restarts the run at its
last checkpoint with every replica at that step's version, as a run starts at step 0
with every replica at version 0: the steps from there are built from that step
(``build_calls(first=...)``), and run.json's ``extensions`` says where, so ``rpeg
verify`` checks them the same way.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.runtime.core.choices import restarts_at_cut
from rpeg.runtime.dask.checkpointing import replan
from rpeg.runtime.dask.driver import RunOptions, RunResult
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.inputs import changed_since, check_inputs, from_older_record
from rpeg.runtime.lowering.instances import lookback
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir import files as rf
from rpeg.runtime.rundir import outputs as O
from rpeg.runtime.rundir.check import check_meta, check_plan_of_run
from rpeg.runtime.rundir.directory import RunDir
from rpeg.runtime.rundir.meta import Extension, Resume, RunMeta, Status
from rpeg.runtime.rundir.serial import loads, plan_from_json
from rpeg.runtime.rundir.state import state_at
from rpeg.spec.lower import MAX_STEPS


def resume_run(run_dir: str | Path, options: RunOptions | None = None,
               resilience: Resilience = Resilience(), *, devices: int | None = None,
               on_step=None, steps: int | None = None) -> RunResult:
    """Continue a run directory from its last complete checkpoint (re-planned for
    ``devices`` when that differs from the plan's device count; extended to ``steps``
    when that is more than it was made with)."""
    rd = _open_for_resume(Path(run_dir))
    with rf.RunLock.take(rd.path):
        meta = _run_meta(rd)
        pipeline = from_older_record(_load_value(rd, "pipeline.json", loads, "pipeline"),
                                     _text(meta.extra.get("spec_dir")))
        plan = _load_value(rd, "plan.json", plan_from_json, "plan")
        check_plan_of_run(rd, pipeline, plan)
        check_inputs(pipeline, resumed=True)    # the files the run read, where it read them
        _spec_edited(rd, meta)
        for path in changed_since(meta.files, pipeline):
            print(f"rpeg: warning: {path} changed since the run started: the steps from "
                  f"here read it as it is now (the run's earlier steps read it as it was)",
                  file=sys.stderr)
        skipped: list[str] = []
        ck = ckio.latest(rd.path, skipped=skipped, check=_tensors_checked(pipeline))
        for s in skipped:
            print(f"rpeg: warning: skipping a damaged checkpoint: {s}", file=sys.stderr)
        if ck is None:
            raise _nothing_to_resume(rd, meta, len(skipped))
        made_for = int(ck.state.get("run_steps", meta.steps))
        total = _steps_wanted(steps, meta, ck, rd)
        aside = _aside_name(rd)
        state = state_at(rd, ck, aside)            # checks metrics and events, then cuts
        damaged = [str(ckio.set_aside(p, "damaged").name) for p in _newer(rd, ck.step)]
        ckio.prune(rd.path, keep=10**6)             # drop interrupted writes only
        O.cut_back(rd.path, state.start, aside)     # samples and evaluations, as the metrics
        kept = sorted(p.name for p in rd.path.glob(f"*.{aside}.jsonl"))
        if kept or damaged:
            print(f"rpeg: kept what ran past {ck.path.name}: "
                  + ", ".join(kept + [f"checkpoints/{d}" for d in damaged]), file=sys.stderr)
        if restarts_at_cut(ck.step, lookback(pipeline, plan), made_for, total):
            # the cut was made for a run that ended near it: restart there, every replica
            # at the checkpoint's version (what ran past the cut is run again)
            state.base, state.carry, state.pending = ck.step, {}, defaultdict(list)
            meta.extensions.append(Extension(ck.step, made_for, total, time.time()))
        if devices is not None and devices != plan.num_devices:
            plan = replan(pipeline, plan, devices, meta, rd, why="resumed onto "
                           f"{devices} device(s)", from_step=state.start, state=state)
        meta.steps = total
        if state.start >= total and meta.status is Status.OK:
            print(f"rpeg: {rd.path} is complete ({total} steps); nothing to resume",
                  file=sys.stderr)
            return RunResult(rd.path, tuple(state.metrics), float(meta.wall_s or 0.0), total)
        meta.resumes.append(Resume(state.start, time.time(), str(ck.path), kept, damaged))
        meta.status = Status.RUNNING
        options = options or RunOptions()
        options = attrs.evolve(options, steps=total, run_dir=str(rd.path))
        print(f"rpeg: resuming {rd.path} at step {state.start} of {total} from {ck.path.name}",
              file=sys.stderr)
        return run_resilient(pipeline, plan, options, None, resilience, on_step,
                             _resume=(rd, state, meta))


def _spec_edited(rd: RunDir, meta: RunMeta) -> None:
    """Warn where the spec the run started from reads otherwise now than its copy in the
    run directory (spec.rpeg): a resume runs the copy, whatever the file says now."""
    kept = rd.path / "spec.rpeg"
    if not meta.spec or not kept.is_file() or not os.path.isfile(meta.spec):
        return
    try:
        same = Path(meta.spec).read_bytes() == kept.read_bytes()
    except OSError:
        return
    if not same:
        print(f"rpeg: warning: {meta.spec} was edited since the run started; a resume "
              f"continues the run's own spec ({kept}), not the edit: `rpeg run "
              f"{meta.spec}` starts a run of the edited one", file=sys.stderr)


def _run_meta(rd: RunDir) -> RunMeta:
    """run.json as a value, once checked; RuntimeFailure naming the file when a field is
    not what rpeg writes."""
    path = rd.path / "run.json"
    value = check_meta(rd.read_json("run.json"), path)
    try:
        return RunMeta.from_json(value)
    except (TypeError, ValueError, AttributeError) as e:
        raise RuntimeFailure(f"run record '{path}' must be what rpeg wrote, and it is not "
                             f"({type(e).__name__}: {e})"[:400], Span(str(path), 0, 0),
                             hint="this is not a run.json rpeg run wrote") from None


def recorded_cadence(run_dir: str | Path) -> int | None:
    """The steps between checkpoints a run was made with (run.json; 0: none between
    evals and the end), so that a resume keeps them unless told otherwise; None when the record does not say (the resume then says
    what is wrong with it)."""
    try:
        meta = rf.read_json(Path(run_dir) / "run.json", "run record")
    except (RpegError, OSError):
        return None
    every = meta.get("checkpoint_every") if isinstance(meta, dict) else None
    return every if isinstance(every, int) and not isinstance(every, bool) and every >= 0 \
        else None


def _tensors_checked(pipeline):
    """A checkpoint's tensors read and checked against the pipeline's models by the backend
    (``backends.load``), as the workers will read them: damage the manifest cannot see
    (a tensor of the wrong shape, NaN, one missing) is found before the resume chooses."""
    import backends
    check = backends.load("torch", "check_checkpoint")
    return lambda ck: check(ck.path, pipeline, ck.state)


def _nothing_to_resume(rd: RunDir, meta: RunMeta, damaged: int) -> RuntimeFailure:
    spec = meta.spec if isinstance(meta.spec, str) else "SPEC.rpeg"
    spec = " ".join([spec, *(str(o) for o in meta.overrides)])     # as it was run
    why = f"its {damaged} checkpoint(s) are damaged" if damaged else "it holds none"
    return RuntimeFailure(f"run directory '{rd.path}' must hold a complete checkpoint to "
                          f"resume from, and {why}; nothing of it can be continued",
                          Span(str(rd.path / "checkpoints"), 0, 0),
                          hint=f"start the run anew in another directory: rpeg run {spec} "
                               "--run-dir NEW_DIR (this one stays as it is)")


def _aside_name(rd: RunDir) -> str:
    """``set-aside-N``, the first N no file of the run directory uses yet."""
    n = 1
    while any(rd.path.glob(f"*.set-aside-{n}.jsonl")):
        n += 1
    return f"set-aside-{n}"


def _newer(rd: RunDir, step: int) -> list[Path]:
    """Complete checkpoints after ``step`` (the resume passed them over as damaged)."""
    root = ckio.folder(rd.path)
    return sorted(p for p in root.glob("step-*") if "." not in p.name
                  and p.name[5:].isdigit() and int(p.name[5:]) > step
                  and (p / ckio.MARKER).exists())


def _steps_wanted(steps: int | None, meta: RunMeta, ck, rd: RunDir) -> int:
    """The steps the resumed run has: ``--steps`` when given (never fewer than the
    checkpoint has done), else run.json's."""
    done = ck.step if ck is not None else 0
    total = meta.steps if steps is None else steps
    if not 1 <= total <= MAX_STEPS:
        raise RuntimeFailure(f"--steps must be 1..{MAX_STEPS:,}, not {total:,}")
    if total < done:
        where = "--steps" if steps is not None else f"run record '{rd.path / 'run.json'}' steps"
        raise RuntimeFailure(f"{where} must be at least the {done} steps its checkpoint has "
                             f"done, not {total}", Span(str(rd.path / "run.json"), 0, 0),
                             hint=f"resume with --steps {max(done, 1)} or more")
    return total


def _open_for_resume(path: Path) -> RunDir:
    if not path.is_dir():
        raise RuntimeFailure(f"run directory '{path}' must exist, and it does not",
                             hint="pass a directory made by `rpeg run`")
    missing = [f for f in ("run.json", "pipeline.json", "plan.json")
               if not os.path.lexists(path / f)]
    if missing:
        raise RuntimeFailure(f"run directory '{path}' must hold {', '.join(missing)}, and it "
                             "does not", hint="pass a directory made by `rpeg run`")
    rf.check_entries(path)
    ckio.folder(path)                               # a symlinked checkpoints/ is refused
    return RunDir(path.resolve())


def _load_value(rd: RunDir, name: str, parse, what: str):
    path = rd.path / name
    text = rf.read_text(path, f"{what} file", ckio.MAX_JSON_BYTES)
    try:
        return parse(text)
    except RpegError as e:
        if e.span is None or not e.span.path or e.span.path.startswith("<"):
            raise RuntimeFailure(f"{what} file '{path}' is unusable: {e.message}",
                                 Span(str(path), 0, 0), hint=e.hint) from None
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise RuntimeFailure(f"{what} file '{path}' must be what rpeg wrote, and it is not "
                             f"({why})"[:400], Span(str(path), 0, 0)) from None


def _text(value) -> str | None:
    return value if isinstance(value, str) else None
