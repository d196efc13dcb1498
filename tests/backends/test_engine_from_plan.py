"""The executor generates with the engine the plan chose, not only an explicit ``engine = vllm``."""

from __future__ import annotations

from types import SimpleNamespace

import backends.vllm_backend.colocated as colocated
from backends.torch_backend.executor import Executor
from rpeg.graph.work import Work
from rpeg.plan.model import Plan, StagePlacement
from rpeg.spec.model import Engine, OpKind


def _engine_for(plan_engine: Engine, monkeypatch):
    monkeypatch.setattr(colocated, "colocated_engine", lambda replica, options: "vllm-engine")
    plan = Plan("p", "c", 1, (StagePlacement.of("rollout", (0,), engine=plan_engine),))
    # the spec says auto (no engine parameter): only the plan can say vLLM
    stage = SimpleNamespace(name="rollout", target="actor",
                            param=lambda key, default=None: default)
    pipeline = SimpleNamespace(stage=lambda _: stage,
                               model=lambda _: SimpleNamespace(dtype="bf16"))
    # a CPU worker (no GPU of its own), whose engine shares its device with nobody asleep
    # and whose stage sets no batching of its own (its Work's)
    ex = SimpleNamespace(ctx=SimpleNamespace(plan=plan, num_devices=1, pipeline=pipeline),
                         device_index=0, _gpus=lambda devices: "",
                         _sleeps=lambda devices: False,
                         works={"rollout": Work("rollout", OpKind.GENERATE, workload=None)})
    ex._concurrency = lambda s: Executor._concurrency(ex, s)
    replica = SimpleNamespace(engine=SimpleNamespace(version=0), version=3)
    return Executor._engine(ex, stage, replica), replica


def test_plan_choosing_vllm_generates_with_vllm(monkeypatch):
    engine, _ = _engine_for(Engine.VLLM, monkeypatch)
    assert engine == "vllm-engine"


def test_plan_choosing_torch_generates_with_torch(monkeypatch):
    engine, replica = _engine_for(Engine.TORCH, monkeypatch)
    assert engine is replica.engine and engine.version == 3
