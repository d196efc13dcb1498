"""The analytical cost model: time and memory of every op under a parallel layout.

    >>> from rpeg.cost import estimate_stage, builtin_cluster

    >>> from rpeg.graph.layout import Layout
    >>> from rpeg.graph import work_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> p, c = ppo_pipeline("llama3.1-8b", prompts=512), builtin_cluster("gh200_64")
    >>> cost = estimate_stage(work_of(p, "rollout"), Layout(dp=2, tp=4), tuple(range(8)), c)
    >>> cost.time_s > 0
    True

Pure functions over (pipeline, stage, parallel layout, devices, cluster); no torch.
Loading or measuring profiles is the caller's business (``rpeg calibrate``).
"""

from rpeg.cost.compute import Gemm, forward_flops, gemm_time, pass_time
from rpeg.cost.engines import EngineTerms, engine_terms
from rpeg.cost.memory import (
    MemoryCost,
    check_fits,
    check_parallel,
    fits,
    local_params,
    model_params,
    resident_memory,
    value_bytes,
)
from rpeg.cost.profiles import (
    builtin_cluster,
    builtin_profile,
    cluster_of,
    load_cluster,
    load_profile,
    profile_text,
)
from rpeg.cost.stages import (
    StageCost,
    dp_group,
    estimate_stage,
    generation_chunks,
    pp_group,
    stage_memory,
    tp_group,
    weight_sync_time,
)
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.errors import CostError
from rpeg.graph.layout import Layout
from rpeg.spec.model import Engine

__all__ = [
    # layouts and results
    "Layout", "StageCost", "MemoryCost", "CostError", "Engine",
    # topology and communication
    "Topology", "Collective", "collective_time", "weight_sync_time",
    # compute, and the engines that run it
    "estimate_stage", "generation_chunks", "Gemm", "gemm_time", "pass_time", "forward_flops",
    "EngineTerms", "engine_terms",
    # memory
    "stage_memory", "resident_memory", "local_params", "model_params", "value_bytes",
    "check_parallel", "check_fits", "fits",
    # device groups
    "tp_group", "pp_group", "dp_group",
    # profiles and clusters
    "builtin_profile", "builtin_cluster", "cluster_of", "load_profile", "load_cluster",
    "profile_text",
]
