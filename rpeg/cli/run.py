"""``rpeg run FILE.rpeg|plan.json``: execute a pipeline on Dask and write a run directory.

    $ rpeg run pipelines/tiny_ppo.rpeg                      # local cluster: 2 worker processes
    step 60/60 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ reward 0.412  step 0.12s
    run: runs/tiny_ppo-20261130-011500  (60 steps, 9.8 s; reward 0.167 -> 0.412)
    $ rpeg run plan.json --spec pipelines/tiny_ppo.rpeg --scheduler tcp://10.0.0.5:8786

Without a plan file the plan is compiled here, told what this runtime can execute, for
the cluster ``--cluster`` names or, by default, the local cluster on this machine priced
with this machine's own profile: calibrated on first use and cached per CPU
(``rpeg.runtime.calibrate.machine``; ``--profile shipped`` or ``RPEG_LOCAL_PROFILE=shipped`` plans
with the shipped ``pipelines/clusters/local_cpu.rpeg`` instead, and says it was measured
elsewhere). ``--staleness K`` plans the run again under the spec's bounds capped at K
(a plan file: its staleness and carry capped, priced again on its cluster), so the run's
plan.json predicts what runs; a K above the spec's bounds is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rpeg.errors import RpegError, RuntimeFailure
from rpeg.plan.options import MAX_SEED
from rpeg.resources import clusters_dir
from rpeg.runtime.dask.devices import COLLECTIVE_TIMEOUT_S
from rpeg.runtime.plans import RunStrategy
from rpeg.spec.lower import MAX_STEPS

DEFAULT_CLUSTER = clusters_dir() / "local_cpu.rpeg"


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        file: Path = typer.Argument(None, help="A pipeline (.rpeg) or a compiled plan (.json)."),
        overrides: list[str] = typer.Argument(
            None, help="KEY=VALUE changes to the pipeline, checked like the spec: "
                       "workload.steps=20 model.actor.optimizer.lr=1e-5 stage.rollout.temperature=0.7"),
        scheduler: str = typer.Option(None, "--scheduler",
                                      help="Attach to a Dask scheduler (tcp://HOST:8786) "
                                           "whose workers each have --resources GPU=1."),
        steps: int = typer.Option(None, "--steps", min=1, max=MAX_STEPS,
                                  help="Steps to run (default: the workload's), priced as a run "
                                       "that long; with --resume, the steps the run is "
                                       "extended to."),
        run_dir: Path = typer.Option(None, "--run-dir", help="Write the run here."),
        resume: Path = typer.Option(None, "--resume", help="Continue a run directory."),
        spec: Path = typer.Option(None, "--spec", help="The pipeline a plan.json was compiled from."),
        cluster: Path = typer.Option(None, "--cluster", help="Cluster file for planning "
                                     "(default: this machine, see --profile)."),
        profile: str = typer.Option(None, "--profile",
                                    help="Without --cluster: auto (this machine's profile, "
                                         "calibrated once and cached), calibrate (measure "
                                         "again) or shipped (the shipped local_cpu profile, "
                                         "measured elsewhere); default $RPEG_LOCAL_PROFILE or "
                                         "auto."),
        strategy: RunStrategy = typer.Option(RunStrategy.SEARCH, "--strategy",
                                             case_sensitive=False,
                                             help="Plan a pipeline with the search or a baseline, "
                                                  "or runtime-split: the runtime's own split "
                                                  "placement, no planner."),
        staleness: int = typer.Option(None, "--staleness", min=0,
                                      help="Plan the run with every staleness bound capped "
                                           "at K (0 = synchronous); a plan file is capped "
                                           "and priced again. At most the spec's bound."),
        seed: int = typer.Option(None, "--seed", min=0, max=MAX_SEED,
                                 help="Planner seed (default 0)."),
        cuda: bool = typer.Option(None, "--cuda/--cpu", help="Run ops on each worker's GPU "
                                  "(--cuda: every worker must have one), or on CPU (--cpu); "
                                  "default: on GPUs when every device worker has one."),
        collective_timeout: float = typer.Option(
            COLLECTIVE_TIMEOUT_S, "--collective-timeout", min=1.0,
            help="Seconds a collective (a data-parallel or weight-sync exchange) waits for "
                 "its partners before it fails."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
        checkpoint_every: int = typer.Option(None, "--checkpoint-every", min=0,
                                             help="Steps between checkpoints (0: only at the "
                                                  "eval steps and the end; no recovery from "
                                                  "worker loss); default the spec's "
                                                  "checkpoint_every (10 unless set), with "
                                                  "--resume the run's own. The plan is "
                                                  "priced at it."),
        op_timeout: float = typer.Option(120.0, "--op-timeout", min=1.0,
                                         help="Least seconds before an op counts as stuck "
                                              "(10x its predicted time when that is longer)."),
        devices: int = typer.Option(None, "--devices", min=1,
                                    help="With --resume: continue on this many devices "
                                         "(re-plans when it differs)."),
        tracker: list[str] = typer.Option(None, "--tracker",
                                          help="Log to this tracker (tensorboard, wandb, "
                                               "mlflow; repeat for several) instead of the "
                                               "spec's log { trackers = [...] }."),
        tls_ca: Path = typer.Option(None, "--tls-ca", help="CA certificate (PEM) for a tls:// "
                                    "scheduler; also RPEG_TLS_CA."),
        tls_cert: Path = typer.Option(None, "--tls-cert", help="This client's certificate "
                                      "(PEM); also RPEG_TLS_CERT."),
        tls_key: Path = typer.Option(None, "--tls-key", help="This client's private key "
                                     "(PEM, mode 600); also RPEG_TLS_KEY."),
        force: bool = typer.Option(False, "--force", help="Run a plan with a spec other than "
                                   "the one it was compiled from (a warning, not an error)."),
    ) -> None:
        """Run a pipeline on a Dask cluster; write runs/<pipeline>-<time>/ (verify it with rpeg verify)."""
        from rpeg.cost.checkpoint import CHECKPOINT_EVERY
        from rpeg.runtime import RunOptions, plan_for_run, run_pipeline
        from rpeg.runtime.dask.resume import recorded_cadence, resume_run
        from rpeg.runtime.dask.runner import Resilience, run_resilient
        from rpeg.runtime.dask.security import TlsFiles, check_scheduler_address, dask_tls

        tls = TlsFiles.resolve(*(str(p) if p else None for p in (tls_ca, tls_cert, tls_key)))
        check_scheduler_address(scheduler, tls)
        _usage(file, resume, spec, strategy, devices, cluster, staleness, profile, scheduler,
               force, run_dir=run_dir, seed=seed)
        seed = seed or 0
        if resume is not None:
            if checkpoint_every is None:
                recorded = recorded_cadence(resume)
                checkpoint_every = CHECKPOINT_EVERY if recorded is None else recorded
            resilience = Resilience(checkpoint_every=checkpoint_every,
                                    timeout_floor_s=op_timeout)
            with dask_tls(tls):
                result = resume_run(resume, RunOptions(scheduler=scheduler, progress=progress,
                                                       use_cuda=cuda,
                                                       collective_timeout_s=collective_timeout,
                                                       trackers=tuple(tracker or ())),
                                    resilience, devices=devices, steps=steps)
            print(f"run: {result.path}  ({result.steps} steps, resumed)")
            return
        choice = _choice(profile)
        parsed = _overrides(overrides or [])
        planned_here = file.suffix != ".json" and strategy is not RunStrategy.RUNTIME_SPLIT
        if cluster is None and scheduler is None and planned_here:
            _check_spec(file, parsed, overrides or [])   # a broken spec before calibrating
            from rpeg.runtime.calibrate.machine import local_profile
            local = local_profile(choice)                  # this machine's, or said it is not
            cluster = local.cluster
            print(local.note, file=sys.stderr)
        if file.suffix != ".json":
            cluster = cluster or DEFAULT_CLUSTER    # a plan file is priced on its own cluster
        if scheduler is not None:                   # too few workers: said before planning
            from rpeg.runtime.dask.driver import check_scheduler
            with dask_tls(tls):
                check_scheduler(scheduler, *_devices_needed(file, cluster))
        try:
            pipeline, plan, spec_path = plan_for_run(
                file, spec=spec, cluster=cluster, strategy=strategy,
                staleness=staleness, seed=seed, overrides=parsed, force=force,
                checkpoint_every=checkpoint_every, steps=steps)
        except RpegError as e:
            _show_override(e, overrides or [])
            raise
        cadence = pipeline.workload.checkpoint_every       # the flag's, else the spec's
        options = RunOptions(steps=steps, scheduler=scheduler,
                             run_dir=str(run_dir) if run_dir else None, progress=progress,
                             use_cuda=cuda, trackers=tuple(tracker or ()),
                             collective_timeout_s=collective_timeout,
                             overrides=tuple(overrides or ()))
        with dask_tls(tls):
            if cadence:
                result = run_resilient(pipeline, plan, options, spec_path=str(spec_path),
                                       resilience=Resilience(checkpoint_every=cadence,
                                                             timeout_floor_s=op_timeout))
            else:
                result = run_pipeline(pipeline, plan, options, spec_path=str(spec_path))
        rewards = [m["reward"] for m in result.metrics if "reward" in m]
        tail = f"; reward {rewards[0]:.3f} -> {sum(rewards[-5:]) / len(rewards[-5:]):.3f}" \
            if rewards else ""
        print(f"run: {result.path}  ({result.steps} steps, {result.wall_s:.1f} s{tail})")


def _usage(file: Path | None, resume: Path | None, spec, strategy: RunStrategy, devices,
           cluster, staleness, profile, scheduler, force: bool = False,
           run_dir: Path | None = None, seed: int | None = None) -> None:
    """Usage errors (exit 2): what to run missing, or options that do nothing with it."""
    def bad(text: str, hint: str) -> None:
        raise typer.BadParameter(text, param_hint=hint)

    if resume is not None:
        if file is not None and "=" in str(file):       # KEY=VALUE, read as the FILE
            bad(f"continues the run directory's own pipeline; an override ({file}) cannot "
                "go with it (--steps extends the run)", "--resume")
        if file is not None:
            bad("continues a run directory; give no FILE with it", "--resume")
        for given, name in ((spec, "--spec"), (cluster, "--cluster"), (staleness, "--staleness"),
                            (profile, "--profile")):
            if given is not None:
                bad("the run directory holds the spec and the plan it continues; it cannot go "
                    "with --resume", name)
        if strategy is not RunStrategy.SEARCH:
            bad("the run directory holds the plan it continues; it cannot go with --resume",
                "--strategy")
        if force:
            bad("runs a plan file with another spec; a resumed run keeps its own", "--force")
        if run_dir is not None:
            bad("a resumed run goes on in its own directory (--resume names it); copy the "
                "directory first to continue a copy", "--run-dir")
        if seed is not None:
            bad("seeds the planner; a resumed run keeps its plan (--devices re-plans it with "
                "the runtime's split, which draws nothing)", "--seed")
        return
    if file is None:
        bad("a pipeline (.rpeg) or a plan (.json) to run, or --resume RUN_DIR, is needed",
            "FILE")
    if devices is not None:
        bad("re-plans a resumed run; it goes with --resume", "--devices")
    if file.suffix == ".json":
        if strategy is not RunStrategy.SEARCH:
            bad("chooses how a pipeline is planned; a plan file is planned already",
                "--strategy")
        if profile is not None:
            bad("chooses the profile a pipeline is planned with; a plan file is planned "
                "already", "--profile")
        if cluster is not None and staleness is None:
            bad("prices a plan file again only with --staleness; a plan file is planned "
                "already", "--cluster")
        return
    if spec is not None:
        bad("names the pipeline of a plan file; FILE is a pipeline itself", "--spec")
    if force:
        bad("runs a plan file with a spec other than its own; FILE is a pipeline itself",
            "--force")
    if profile is not None and (cluster is not None or scheduler is not None
                                or strategy is RunStrategy.RUNTIME_SPLIT):
        bad("prices the plan with this machine when the run plans for it; with --cluster, "
            "--scheduler or --strategy runtime-split it does not", "--profile")


def _devices_needed(file: Path, cluster: Path | None) -> tuple[int, str]:
    """(the devices the run will ask its scheduler for, what needs them): a plan file's,
    else those of the cluster it is planned for."""
    if file.suffix == ".json":
        from rpeg.plan.model import Plan
        return Plan.load(file).num_devices, f"the plan {file}"
    from rpeg.spec import load_cluster
    path = cluster or DEFAULT_CLUSTER
    return load_cluster(path).num_gpus, f"a plan for the cluster {path}"


def _check_spec(file: Path, parsed: tuple, texts: list[str]) -> None:
    """The spec as the run will read it, checked before this machine is calibrated (minutes
    on first use), so a mistake in it is said at once."""
    from rpeg.spec import load
    try:
        load(file, parsed)
    except RpegError as e:
        _show_override(e, texts)
        raise


def _overrides(texts: list[str]) -> tuple:
    from rpeg.spec.overrides import parse_overrides
    try:
        return parse_overrides(texts)
    except RpegError as e:
        _show_override(e, texts)
        raise


def _show_override(err: RpegError, texts: list[str]) -> None:
    """An error at an override shows that override, with the caret under the column."""
    from rpeg.spec.overrides import WHERE, source_text
    if err.span is not None and err.span.path == WHERE:
        err.source_text = source_text(texts)


def _choice(value: str | None):
    """--profile's value (else $RPEG_LOCAL_PROFILE's) as a ProfileChoice: a usage error for
    a flag that is none of them, an error naming the variable for its value."""
    from rpeg.runtime.calibrate.machine import choice_from_env
    if value is None:
        return choice_from_env()
    try:
        return choice_from_env(value)
    except RuntimeFailure:
        raise typer.BadParameter(f"must be auto, calibrate or shipped, not {value!r}",
                                 param_hint="--profile") from None
