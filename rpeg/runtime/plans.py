"""Which plan a run executes: a compiled plan file, or one compiled now for the cluster at hand.

    >>> pipeline, plan, spec = plan_for_run(Path("pipelines/tiny_ppo.rpeg"),
    ...                                     cluster="pipelines/clusters/local_cpu.rpeg")  # doctest: +SKIP
    >>> plan.num_devices, plan.strategy                                                # doctest: +SKIP
    (2, <Strategy.SEARCH: 'search'>)

The planner is told what this runtime executes (:func:`runtime_limits`): what its
backends declare (:mod:`rpeg.plan.capabilities`), with the engines installed here,
since ``rpeg run`` executes here. ``--strategy runtime-split`` skips the planner and
uses the runtime's own split placement (``rpeg.runtime.placement``).
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import attrs

from rpeg.errors import PlanError, RuntimeFailure
from rpeg.graph.versions import carry_room
from rpeg.runtime.placement import split_plan


class RunStrategy(enum.Enum):
    """How ``rpeg run`` plans a pipeline: the search, a baseline, or the runtime's own
    split placement without the planner."""
    SEARCH = "search"
    COLOCATED = "colocated"
    SPLIT = "split"
    REALLOC = "realloc"
    RUNTIME_SPLIT = "runtime-split"


def runtime_limits():
    """The planner's ``Limits`` for a run on this machine: the runtime's declared
    capabilities (``Limits.runtime``, the same wherever it is asked), less the generation
    engines that are not installed here (vLLM is an optional extra)."""
    from rpeg.plan.space import Limits
    limits = Limits.runtime()
    missing = {e for e in limits.engines if not engine_installed(e)}
    if not missing:
        return limits
    return attrs.evolve(limits, engines=limits.engines - missing,
                        carry_engines=limits.carry_engines - missing,
                        engine_tp=tuple(x for x in limits.engine_tp if x[0] not in missing))


def engine_installed(engine) -> bool:
    """Whether a generation engine's backend can run here (vLLM: its package is found)."""
    from rpeg.spec.model import Engine
    if engine is not Engine.VLLM:
        return True
    try:
        import backends
        return backends.load("vllm", "available")()[0]
    except Exception:  # noqa: BLE001 — a broken optional backend is an absent one
        return False


def plan_for_run(file: str | Path, *, spec: str | Path | None = None,
                 cluster: str | Path | None = None,
                 strategy: RunStrategy = RunStrategy.SEARCH,
                 staleness: int | None = None, seed: int = 0, overrides: tuple = (),
                 force: bool = False, checkpoint_every: int | None = None,
                 steps: int | None = None):
    """(pipeline, plan, spec path) for ``rpeg run FILE``; ``overrides``
    (``rpeg.spec.overrides``) change the spec before it is checked.

    A plan file is checked against its spec and, when one is given or the plan names one
    that is there, its cluster (``rpeg.plan.validate``; ``force``: a different spec is a
    warning).

    ``staleness`` K plans the run under every staleness bound of the spec capped at K
    (0: synchronous; a partial rollout's carry spends the same bound): a pipeline is
    planned again under the capped bounds; a plan file keeps its placement, its stages'
    staleness and carry are capped and it is priced again on its cluster (``cluster``,
    else the one it records). K above the spec's largest bound is refused: the spec's
    bound is the contract, which a run may tighten but not loosen.

    ``checkpoint_every`` N (``rpeg run --checkpoint-every``) replaces the workload's cadence
    before the plan is made, so that it is priced at the cuts the run makes; a plan file
    priced at another cadence is priced again on its cluster (said, when its cluster file
    is not there). ``steps`` N (``rpeg run --steps``) likewise replaces the workload's
    steps: a step's share of the checkpoints and evals is that of a run of N steps."""
    from rpeg.plan.staleness import explicit
    from rpeg.spec import load, load_cluster

    file = Path(file)
    if file.suffix == ".json":
        from rpeg.plan.validate import open_plan
        opened = open_plan(file, spec=spec, cluster=cluster, force=force, overrides=overrides)
        plan, pipeline, machine, spec_path = (opened.plan, opened.pipeline, opened.cluster,
                                              opened.spec_path)
        warnings = opened.warnings
        for w in warnings:
            print(f"{file}: warning: {w}", file=sys.stderr)
        if warnings:              # run with another spec, as asked: the hash no longer applies
            plan = attrs.evolve(plan, spec_hash="")
        _check_cap(pipeline, staleness)
        plan = explicit(pipeline, plan)             # a stage the plan does not list: 0
        was = pipeline.workload
        pipeline = with_run(pipeline, checkpoint_every, steps)
        if pipeline.workload != was:
            plan = _run_priced(file, pipeline, plan, was, opened.cluster_path)
        if staleness is not None:
            plan = _capped_plan(pipeline, plan, staleness, opened.cluster_path)
        if machine is not None:
            plan = settled(pipeline, plan, machine)
        from rpeg.plan.compile import check_executable
        check_executable(plan, runtime_limits())         # a hand-written plan asks too much
        from rpeg.runtime.lowering.instances import build_calls
        build_calls(pipeline, plan, steps=1)              # degrees the backend cannot split by
    else:
        spec_path = file
        pipeline = with_run(load(file, overrides), checkpoint_every, steps)
        _check_cap(pipeline, staleness)
        c = load_cluster(cluster) if cluster else None
        if strategy is RunStrategy.RUNTIME_SPLIT:
            plan = split_plan(pipeline, c.num_gpus if c else 2, staleness=staleness,
                              cluster=c.name if c else "local")
            plan = settled(pipeline, plan, c) if c is not None else plan
        else:
            plan = _compile(pipeline, c, strategy, seed, staleness)
    return pipeline, plan, spec_path


def with_run(pipeline, checkpoint_every: int | None, steps: int | None):
    """``pipeline`` with the workload's cadence and steps the run's own where given."""
    w = pipeline.workload
    new = attrs.evolve(w, checkpoint_every=w.checkpoint_every if checkpoint_every is None
                       else checkpoint_every, steps=w.steps if steps is None else steps)
    return pipeline if new == w else attrs.evolve(pipeline, workload=new)


def _run_priced(file: Path, pipeline, plan, was, cluster):
    """A plan file, priced for the workload ``was`` (its cadence and steps), priced again
    for the run's; kept as it is, and said, when it has no prediction or its cluster file
    is not here."""
    if plan.predicted is None:
        return plan
    where = cluster or plan.cluster_path
    if not where or not Path(where).is_file():
        w = pipeline.workload
        said = []
        if w.checkpoint_every != was.checkpoint_every:
            every = w.checkpoint_every
            said.append(f"a checkpoint every {was.checkpoint_every} steps (its spec's "
                        f"checkpoint_every) and this run cuts "
                        f"{f'every {every} steps' if every else 'only at the eval steps and the end'}")
        if w.steps != was.steps:
            said.append(f"a run of {was.steps} steps (its spec's) and this run takes {w.steps}")
        print(f"{file}: warning: the plan's predicted step time prices {'; '.join(said)}; its "
              f"cluster file ({where or 'none recorded'}) is not here to price it again",
              file=sys.stderr)
        return plan
    return _priced(pipeline, plan, where)


def _check_cap(pipeline, staleness: int | None) -> None:
    """``--staleness K`` tightens the spec's bounds; a K above them all is refused."""
    top = max((k for _, k in pipeline.staleness), default=0)
    if staleness is not None and staleness > top:
        bounds = ", ".join(f"{s} <= {k}" for s, k in pipeline.staleness) or "none: synchronous"
        raise PlanError(f"--staleness must be at most the spec's largest staleness bound "
                        f"{top}, not {staleness} (the spec's bounds: {bounds})",
                        hint="--staleness tightens the spec's bounds; to allow more, raise "
                             "the bound in the spec (staleness STAGE <= K)")


def _capped_plan(pipeline, plan, cap: int, cluster):
    """A plan file under every staleness bound capped at ``cap``: its stages' staleness
    lowered to the cap (its carry to what the cap leaves beside its staleness), priced
    again on its cluster (a plan written without a prediction stays without one)."""
    lags = {st: min(k, cap) for st, k in plan.staleness}
    places = tuple(attrs.evolve(p, carry=min(p.carry, carry_room(cap, lags.get(p.stage, 0))))
                   for p in plan.placements)
    new = attrs.evolve(plan, staleness=tuple(sorted(lags.items())), placements=places)
    if new == plan or plan.predicted is None:
        return new                  # within the cap already, or no prediction to make again
    where = cluster or plan.cluster_path
    if not where or not Path(where).is_file():
        raise PlanError(f"--staleness {cap} re-plans the plan '{plan.pipeline}' and prices it "
                        f"again on its cluster, whose file must exist, not be missing "
                        f"({where or 'none recorded'})", hint="pass --cluster CLUSTER.rpeg")
    return _priced(pipeline, new, where)


def _priced(pipeline, plan, cluster):
    """``plan`` priced again for ``pipeline`` on the cluster file ``cluster``."""
    from rpeg.plan.evaluate import Evaluator
    from rpeg.spec import load_cluster
    return Evaluator(pipeline, load_cluster(cluster), engine_kv=runtime_limits().engine_kv
                     ).evaluate(attrs.evolve(plan, predicted=None)).plan


def settled(pipeline, plan, cluster):
    """``plan`` with its generate stages' batching as this runtime runs them
    (``rpeg.plan.evaluate.settle_batching``: a vLLM stage's KV share the plan left at 0 is
    the share the engine takes here), priced again when that changed it."""
    from rpeg.plan.evaluate import Evaluator, settle_batching
    kv = runtime_limits().engine_kv
    new = settle_batching(pipeline, plan, cluster, kv)
    if new == plan or plan.predicted is None:
        return new
    return Evaluator(pipeline, cluster, engine_kv=kv).evaluate(
        attrs.evolve(new, predicted=None), simulate_infeasible=True).plan


def _compile(pipeline, cluster, strategy: RunStrategy, seed: int,
             staleness: int | None = None):
    from rpeg.plan.compile import compile_plan
    from rpeg.plan.model import Strategy
    from rpeg.plan.search import SearchOptions
    from rpeg.runtime.lowering.instances import build_calls

    if cluster is None:
        raise RuntimeFailure("a cluster file is needed to plan the run, and none was given",
                             hint="pass --cluster pipelines/clusters/local_cpu.rpeg")
    options = SearchOptions(seed=seed, limits=runtime_limits(),     # the search's own budget
                            staleness_cap=staleness)
    plan = compile_plan(pipeline, cluster, Strategy(strategy.value), options)
    build_calls(pipeline, plan, steps=1)          # what the planner chose, the runtime lays out
    return plan
