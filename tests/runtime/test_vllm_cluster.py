"""The runtime's own cluster: non-daemon workers exactly when the plan generates with vLLM."""

from __future__ import annotations

import multiprocessing

from rpeg.plan.model import Plan, StagePlacement
from rpeg.runtime.dask.driver import DaskCluster, uses_vllm
from rpeg.spec.model import Engine


def _daemon_flags(vllm: bool) -> set[bool]:
    with DaskCluster(1, None, vllm) as cl:
        return set(cl.client.run(lambda: multiprocessing.current_process().daemon).values())


def test_workers_are_non_daemon_only_for_vllm_plans():
    torch_plan = Plan("p", "c", 1, (StagePlacement.of("rollout", (0,)),))
    vllm_plan = Plan("p", "c", 1, (StagePlacement.of("rollout", (0,), engine=Engine.VLLM),))
    assert not uses_vllm(torch_plan) and uses_vllm(vllm_plan)
    assert _daemon_flags(False) == {True}
    assert _daemon_flags(True) == {False}
    assert _daemon_flags(False) == {True}          # the setting ends with the cluster
