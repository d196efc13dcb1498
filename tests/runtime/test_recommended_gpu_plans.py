"""The plans ``rpeg compile`` recommends for GRPO on Qwen2.5 7B on GPU clusters — vLLM
engines with tensor parallelism, on devices of their own or beside the trainer, carrying
responses over where the search finds that best — are plans the runtime executes: they
pass its declared limits, unroll into op calls, and give each engine its copy of the
actor, its tensor-parallel block and a weight-sync group. (Whether vLLM is installed is
asked by ``rpeg run`` on the machine that runs: it is not installed in this venv.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.cost.engine_sync import sync_layout, sync_senders
from rpeg.plan.compile import check_executable
from rpeg.plan.model import Plan
from rpeg.plan.space import Limits
from rpeg.runtime.lowering.context import RunContext
from rpeg.runtime.lowering.instances import build_calls, engine_key
from rpeg.spec import load
from rpeg.spec.model import Engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cluster", ["gh200_64", "h100_64"])
def test_recommended_plans_for_grpo_qwen7b_are_ones_the_runtime_executes(cluster, tmp_path,
                                                                         capsys):
    out = tmp_path / "plan.json"
    assert main(["compile", str(ROOT / "pipelines/grpo_qwen7b.rpeg"), "--cluster",
                 str(ROOT / f"pipelines/clusters/{cluster}.rpeg"), "-o", str(out)]) == 0
    capsys.readouterr()
    plan, pipeline = Plan.load(out), load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    check_executable(plan, Limits.runtime())
    calls = build_calls(pipeline, plan, steps=3)
    ctx = RunContext.create(pipeline, plan, calls, run_dir=str(tmp_path))
    gen, train = plan.placement("rollout"), plan.placement("actor_step")
    assert gen.engine is Engine.VLLM
    copies = {r.device: r.engine for r in ctx.replicas if r.model == engine_key("actor")}
    blocks = {gen.devices[i]: gen.devices[i:i + gen.tp] for i in range(0, len(gen.devices),
                                                                       gen.tp)}
    if gen.tp > 1 or not set(gen.devices) <= set(train.devices):
        assert copies == blocks                      # one engine per block, its own copy
        (sync,) = ctx.syncs
        # the trainer's first tp block sends, or every device where ZeRO-3 holds shards;
        # engines on devices of their own join the group, the others load in process
        lay = sync_layout(sync_senders(train.devices, train.tp, train.zero), blocks.values())
        assert sync.senders == lay.senders
        assert sync.world == 1 + sum(len(b) for b in lay.group)
        assert set(sync.local) == {b[0] for b in lay.local}
    rollouts = [c for c in calls if c.op == "rollout" and c.step == 2]
    assert {c.device for c in rollouts} <= set(blocks) and all(c.carry == gen.carry
                                                               for c in rollouts)
