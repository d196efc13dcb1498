"""One check of a plan against the spec and cluster it is used with, for every command.

    >>> plan = Plan.load("plan.json")                                       # doctest: +SKIP
    >>> warnings = check_plan(plan, pipeline, path="plan.json", cluster=cluster)  # doctest: +SKIP
    >>> opened = open_plan("plan.json", need_spec=True)                     # doctest: +SKIP
    >>> opened.plan.num_devices, opened.pipeline.name                       # doctest: +SKIP
    (2, 'tiny_ppo')

Reading a plan file (``Plan.load``) already refuses what no plan can hold: wrong
JSON, wrong types, values out of range, devices that are not the plan's. What is
checked here needs the spec, and the cluster when there is one:

* the plan is for this pipeline, and places every stage of it and no other;
* the names it uses resolve: staleness and fusion name stages, model_homes and
  shared name models, a shared group is one the spec allows, a stage's staleness plus
  its carry is within the spec's bound (:mod:`rpeg.plan.staleness`, the rule the cost
  model and the runtime read);
* the spec is the one it was compiled from (``spec_hash``): a different one is an
  error naming both hashes, or a warning with ``--force``;
* the cluster it names (``cluster_path``) is a cluster, and the plan uses no more
  devices than the cluster it runs on has (exactly as many, to simulate it).

``rpeg simulate``, ``run``, ``diff``, ``show`` and ``verify`` all go through
:func:`check_plan`, so a plan one of them refuses, all of them refuse.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from rpeg.errors import PlanError, RpegError, Span, did_you_mean
from rpeg.graph.ids import Backbone
from rpeg.graph.versions import bound_problem
from rpeg.plan.model import Plan
from rpeg.plan.staleness import staleness_problem
from rpeg.spec.model import Cluster, Pipeline
from rpeg.spec.paths import resolve_written


@attrs.frozen
class OpenedPlan:
    """A plan file read and checked, with the spec and cluster it was checked against."""

    plan: Plan
    pipeline: Pipeline
    cluster: Cluster | None
    spec_path: Path
    cluster_path: Path | None
    warnings: tuple[str, ...] = ()


def spec_hash_of_file(path: str | Path, bases: tuple[str, ...] = ()) -> str:
    """The hash ``rpeg compile`` records of a spec file (``Plan.spec_hash``): of its bytes,
    then of each base it extends (``Pipeline.extends``, nearest first), so a plan made
    before a base changed is not taken for the spec's; "" where a file cannot be read."""
    h = hashlib.sha256()
    try:
        h.update(Path(path).read_bytes())
        for base in bases:                 # none: the file's own hash, as it always was
            h.update(b"\0extend\0" + Path(base).read_bytes())
    except OSError:
        return ""
    return h.hexdigest()[:16]


def spec_hash_of(pipeline: Pipeline) -> str:
    """:func:`spec_hash_of_file` of the file ``pipeline`` was read from and its bases."""
    return spec_hash_of_file(pipeline.path, pipeline.extends)


def check_plan(plan: Plan, pipeline: Pipeline, *, path: str, cluster: Cluster | None = None,
               exact_devices: bool = False, force: bool = False,
               spec_hash: str | None = None) -> tuple[str, ...]:
    """PlanError naming ``path`` and the field when ``plan`` cannot be used with
    ``pipeline`` (and ``cluster``); the warnings ``force`` turned errors into.
    ``spec_hash``: the hash of the spec as given (default: of the file it was read from)."""
    where = Span(path, 0, 0)
    hint = "recompile the plan for this spec: rpeg compile SPEC --cluster CLUSTER"
    if plan.pipeline != pipeline.name:
        raise PlanError(f"plan field 'pipeline' must name the spec's pipeline "
                        f"'{pipeline.name}', not '{plan.pipeline}'", where,
                        hint=f"the plan was compiled from pipeline '{plan.pipeline}'"
                             + (f" ({plan.spec_path})" if plan.spec_path else "")
                             + ": use that spec, or " + hint)
    warnings: list[str] = []
    now = spec_hash if spec_hash is not None else spec_hash_of(pipeline)
    if plan.spec_hash and now and plan.spec_hash != now:
        text = (f"plan field 'spec_hash' must match the spec it runs with: the plan was "
                f"compiled from a spec with hash {plan.spec_hash}, and {pipeline.path or 'the spec'} "
                + (f"with the bases it extends ({', '.join(pipeline.extends)}) "
                   if pipeline.extends and spec_hash is None else "")
                + f"has hash {now}")
        if not force:
            raise PlanError(text, where, hint="recompile the plan, or pass --force to use it "
                                              "with this spec anyway")
        warnings.append(text)
    stages = [s.name for s in pipeline.stages]
    _known([(f"placements[{i}].stage", p.stage) for i, p in enumerate(plan.placements)],
           stages, "a stage", pipeline.name, where, hint)
    placed = {p.stage for p in plan.placements}
    missing = [s for s in stages if s not in placed]
    if missing:
        raise PlanError(f"plan field 'placements' must place every stage of pipeline "
                        f"'{pipeline.name}', not leave out '{missing[0]}'"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                        where, hint=hint)
    named = [(f"staleness[{i}]", stage) for i, (stage, _) in enumerate(plan.staleness)]
    named += [(f"fusion[{i}]", stage) for i, group in enumerate(plan.fusion) for stage in group]
    _known(named, stages, "a stage", pipeline.name, where, hint)
    carries = {p.stage: p.carry for p in plan.placements}
    for i, (stage, k) in enumerate(plan.staleness):
        problem = bound_problem(stage, k, carries.get(stage, 0), pipeline.staleness_of(stage))
        if problem:
            raise PlanError(f"plan field 'staleness[{i}]': {problem}", where, hint=hint)
    problem = staleness_problem(pipeline, plan)     # carries: the rule the runtime runs by
    if problem:
        raise PlanError(f"plan field 'placements' carry: {problem}", where, hint=hint)
    _check_models(plan, pipeline, where, hint)
    _check_syncs(plan, pipeline, where)
    if cluster is not None:
        _check_devices(plan, cluster, where, exact_devices)
    return tuple(warnings)


def _check_syncs(plan: Plan, pipeline: Pipeline, where: Span) -> None:
    """A weight sync into a vLLM engine's own copy gives every rank of its process group a
    device of its own (``rpeg.cost.engine_sync.engine_sync_layout``, the layout the runtime
    runs it by): refuse a plan whose engine shares a sending device yet is hosted on one
    that does not send."""
    from rpeg.cost.engine_sync import engine_sync_layout, sync_refusal
    from rpeg.spec.model import Engine, OpKind
    placed = {p.stage: p for p in plan.placements}
    for g in pipeline.stages:
        dst = placed.get(g.name)
        if g.kind is not OpKind.GENERATE or dst is None or dst.engine is not Engine.VLLM:
            continue
        for t in pipeline.stages:
            src = placed.get(t.name)
            if t.kind is not OpKind.TRAIN or t.target != g.target or src is None:
                continue
            why = sync_refusal(engine_sync_layout(src, [dst]))
            if why:
                raise PlanError(f"plan field 'placements' of stage '{g.name}': the weight sync "
                                f"from '{t.name}' must give every rank of its process group a "
                                f"device of its own, and {why}", where,
                                hint="host the engine on a sending device of the trainer, or on "
                                     "devices of its own")


def _check_models(plan: Plan, pipeline: Pipeline, where: Span, hint: str) -> None:
    models = [m.name for m in pipeline.models]
    allowed = [set(g) for g in pipeline.shares]
    named = [(f"shared[{i}]", m) for i, group in enumerate(plan.shared) for m in group]
    named += [(f"model_homes[{i}]", m) for i, (key, _) in enumerate(plan.model_homes)
              for m in Backbone(key).members]
    _known(named, models, "a model", pipeline.name, where, hint)
    for i, group in enumerate(plan.shared):
        if set(group) not in allowed:
            raise PlanError(f"plan field 'shared[{i}]' must be a group the spec allows to "
                            f"share ({'; '.join(', '.join(g) for g in pipeline.shares) or 'none'}"
                            f"), not {', '.join(group)}", where,
                            hint="allow it in the spec with `share A, B`, or " + hint)
    merged = {Backbone.of(g) for g in plan.shared}
    for i, (key, _) in enumerate(plan.model_homes):
        if Backbone(key).shared and key not in merged:
            raise PlanError(f"plan field 'model_homes[{i}]' names the shared backbone '{key}', "
                            "which the plan's 'shared' does not list", where, hint=hint)


def _known(named: list[tuple[str, str]], choices: list[str], what: str, pipeline: str,
           where: Span, hint: str) -> None:
    """Each ``(field, name)`` names one of ``choices``, or a PlanError naming the field."""
    for field, name in named:
        if name not in choices:
            raise PlanError(f"plan field '{field}' must name {what} of pipeline '{pipeline}', "
                            f"not '{name}'", where, hint=did_you_mean(name, choices) or hint)


def _check_devices(plan: Plan, cluster: Cluster, where: Span, exact: bool) -> None:
    have = cluster.num_gpus
    if plan.num_devices > have or (exact and plan.num_devices != have):
        need = "exactly" if exact else "at most"
        raise PlanError(f"plan field 'num_devices' must be {need} the {have:,} devices of "
                        f"cluster '{cluster.name}', not {plan.num_devices:,}", where,
                        hint="recompile the plan for this cluster, or pass the cluster it was "
                             "compiled for (--cluster)")


def recorded_file(recorded: str, plan_file: Path) -> Path | None:
    """A path a plan records (``rpeg compile`` records it absolute; a relative one is
    relative to the plan file's folder, as a spec's paths are to the spec's); None when it
    is not there. Nothing else is looked for: a file of the same name elsewhere may be
    another file."""
    if not recorded:
        return None
    p = resolve_written(recorded, Span(str(plan_file), 0, 0))
    return p if p.exists() else None


def plan_spec(plan: Plan, plan_file: Path, spec: str | Path | None = None) -> Path:
    """The spec a plan is used with: ``spec`` (``--spec``) when given, else the file the plan
    records. The one rule of every command that reads a plan; a PlanError when neither is
    there."""
    if spec:
        return Path(spec)
    found = recorded_file(plan.spec_path, plan_file)
    if found is None:
        raise PlanError("plan must name its spec file, and the one it names is not there"
                        + (f" ({plan.spec_path})" if plan.spec_path else " (it names none)"),
                        Span(str(plan_file), 0, 0),
                        hint="pass the spec it was compiled from with --spec FILE.rpeg")
    return found


def recorded_cluster(plan: Plan, plan_file: Path) -> tuple[Cluster | None, Path | None]:
    """The cluster file the plan names (``cluster_path``), loaded; (None, None) when it is
    not there. A file that is there and is not a cluster is a PlanError naming the field."""
    from rpeg.spec import load_cluster
    found = recorded_file(plan.cluster_path, plan_file)
    if found is None:
        return None, None
    try:
        return load_cluster(found), found
    except RpegError as e:
        raise PlanError(f"plan field 'cluster_path' must name a cluster file, not '{found}' "
                        f"({e.message})", Span(str(plan_file), 0, 0),
                        hint="pass the cluster with --cluster, or recompile the plan") from None


def open_plan(plan_file: str | Path, *, spec: str | Path | None = None,
              cluster: str | Path | None = None, need_cluster: bool = False,
              exact_devices: bool = False, force: bool = False,
              overrides: tuple = ()) -> OpenedPlan:
    """Read a plan file and check it against its spec and cluster: ``spec`` and
    ``cluster`` when given, else the files the plan records (:func:`plan_spec`). A plan
    whose spec is not there is refused, by every command alike; ``need_cluster``: so is
    one whose cluster is not (otherwise it is checked without one). ``overrides``
    (``rpeg.spec.overrides``) change the spec before the plan is checked against it."""
    from rpeg.spec import load, load_cluster
    plan_file = Path(plan_file)
    plan = Plan.load(plan_file)
    where = Span(str(plan_file), 0, 0)
    spec_path = plan_spec(plan, plan_file, spec)
    if cluster:
        machine, cluster_path = load_cluster(cluster), Path(cluster)
    else:
        machine, cluster_path = recorded_cluster(plan, plan_file)
    if machine is None and need_cluster:
        raise PlanError("plan must name its cluster file, and the one it names is not there"
                        + (f" ({plan.cluster_path})" if plan.cluster_path else ""), where,
                        hint="pass --cluster CLUSTER.rpeg")
    pipeline = load(spec_path, overrides)
    warnings = check_plan(plan, pipeline, path=str(plan_file), cluster=machine,
                          exact_devices=exact_devices, force=force)
    return OpenedPlan(plan, pipeline, machine, spec_path, cluster_path, warnings)
