"""Which plan a run executes: a compiled plan file, or one made now for the cluster at hand.

    >>> pipeline, plan, spec = plan_for_run(Path("pipelines/tiny_ppo.rpeg"))   # doctest: +SKIP
    >>> plan.num_devices, plan.strategy                                       # doctest: +SKIP
    (2, <Strategy.SPLIT: 'split'>)
"""

from __future__ import annotations

from pathlib import Path

from rpeg.errors import PlanError, RuntimeFailure
from rpeg.runtime.placement import split_plan


def plan_for_run(file: str | Path, *, spec: str | Path | None = None,
                 cluster: str | Path | None = None, staleness: int | None = None,
                 share: bool = False, dp: int = 1, devices: int | None = None):
    """(pipeline, plan, spec path) for ``rpeg run FILE``."""
    from rpeg.spec import load, load_cluster

    file = Path(file)
    if file.suffix == ".json":
        from rpeg.plan.model import Plan
        plan = Plan.load(file)
        spec_path = Path(spec) if spec else _find_spec(file, plan.pipeline)
        pipeline = load(spec_path)
        if pipeline.name != plan.pipeline:
            raise PlanError(f"plan '{file}' must be for pipeline '{pipeline.name}', "
                            f"not '{plan.pipeline}'", hint="pass the right --spec")
        return pipeline, plan, spec_path
    pipeline = load(file)
    n = devices
    cluster_name = "local"
    if n is None and cluster is not None and Path(cluster).exists():
        c = load_cluster(cluster)
        n, cluster_name = c.num_gpus, c.name
    n = n or 2
    if dp > n:
        raise PlanError(f"--dp must be at most the {n} devices, not {dp}")
    if share and not pipeline.shares:
        raise PlanError("--share needs a 'share' line in the spec, and it has none",
                        hint="add e.g. `share actor, critic`")
    return pipeline, split_plan(pipeline, n, staleness=staleness, share=share, dp=dp,
                                cluster=cluster_name), file


def _find_spec(plan_file: Path, name: str) -> Path:
    for candidate in (plan_file.parent / "spec.rpeg", plan_file.parent / f"{name}.rpeg",
                      Path("pipelines") / f"{name}.rpeg"):
        if candidate.exists():
            return candidate
    raise RuntimeFailure(f"the spec of plan '{plan_file}' (pipeline {name}) must be found, "
                         "and it is not beside the plan", hint="pass it with --spec FILE.rpeg")
