"""One declaration of what rpeg's runtime executes: read without torch or vLLM, the same on
every planning machine, and the same answer from the planner and the runtime's refusals."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from rpeg.errors import PlanError
from rpeg.plan.capabilities import runtime_capabilities
from rpeg.plan.compile import check_executable
from rpeg.plan.model import Plan, StagePlacement
from rpeg.plan.space import Limits
from rpeg.spec.model import Engine

from .conftest import ROOT


def test_reading_the_declaration_imports_neither_torch_nor_vllm():
    code = ("import sys; from rpeg.plan.space import Limits; Limits.runtime(); "
            "print('torch' in sys.modules, 'vllm' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert out == ["False", "False", "False"]


def test_the_limits_are_the_declaration_whatever_is_installed(monkeypatch):
    from backends import vllm_backend
    seen = []
    for found in (True, False):
        monkeypatch.setattr(vllm_backend, "available", lambda found=found: (found, "test"))
        seen.append(Limits.runtime())
    assert seen[0] == seen[1] == Limits.of(runtime_capabilities())
    caps = runtime_capabilities()
    assert seen[0].engines == {e.engine for e in caps.engines}
    assert seen[0].carry_engines == {e.engine for e in caps.engines if e.carry}
    assert seen[0].engine_max_tp(Engine.VLLM) == caps.engine(Engine.VLLM).max_tp


def test_rpeg_run_drops_only_the_engines_missing_here(monkeypatch):
    from backends import vllm_backend
    from rpeg.runtime.plans import runtime_limits
    monkeypatch.setattr(vllm_backend, "available", lambda: (False, "test"))
    here = runtime_limits()
    assert Engine.VLLM not in here.engines and Engine.TORCH in here.engines
    assert attrs.evolve(here, engines=Limits.runtime().engines,
                        carry_engines=Limits.runtime().carry_engines,
                        engine_tp=Limits.runtime().engine_tp) == Limits.runtime()


def _one(stage="actor_step", **kw) -> Plan:
    devices = kw.pop("devices", (0, 1))
    return Plan("p", "c", 2, (StagePlacement.of(stage, devices, **kw),))


@pytest.mark.parametrize("change", [
    dict(dp=1, pp=2), dict(dp=1, tp=2, engine=Engine.VLLM, stage="rollout"),
    dict(dp=2, zero=max(set(range(4)) - Limits.runtime().zero, default=0)),
])
def test_the_planner_and_the_runtime_refuse_the_same_layouts(change, tiny):
    """What ``check_executable`` refuses with the runtime's limits, ``build_calls`` refuses
    too: both read the declaration."""
    from rpeg.runtime.lowering.instances import build_calls
    limits = Limits.runtime()
    plan = _one(**change)
    try:
        check_executable(plan, limits)
        planner_ok = True
    except PlanError:
        planner_ok = False
    stage = plan.placements[0].stage
    placements = tuple(StagePlacement.of(s.name, (0,)) for s in tiny.stages if s.name != stage)
    full = attrs.evolve(plan, pipeline=tiny.name, placements=placements + plan.placements,
                        model_homes=(("actor", (0, 1) if stage == "actor_step" else (0,)),))
    try:
        build_calls(tiny, full, steps=1)
        runtime_ok = True
    except PlanError:
        runtime_ok = False
    assert planner_ok == runtime_ok


def test_lora_adapters_are_planned_only_as_the_runtime_trains_them(ppo8b, a100_16):
    """The torch backend trains LoRA adapters whole (tp 1, ZeRO 0): the runtime's limits
    offer no other layout for a LoRA model, and refuse a pin that asks for one; the
    cost model (every executor) still prices them."""
    from rpeg.plan.choices import enumerate_layouts
    from rpeg.plan.pinned import check_pins
    from rpeg.spec.model import Pin
    from rpeg.spec.training import Lora

    actor = attrs.evolve(ppo8b.model("actor"), lora=Lora(8, 16.0, ("q_proj", "v_proj")))
    lora = attrs.evolve(ppo8b, models=tuple(actor if m.name == "actor" else m
                                            for m in ppo8b.models))
    runtime = enumerate_layouts(lora, "actor_step", (2, 4), a100_16, Limits.runtime())
    assert runtime and all(lay.par.tp == 1 and lay.par.zero.replicated for lay in runtime)
    anywhere = enumerate_layouts(lora, "actor_step", (2, 4), a100_16, Limits())
    assert any(lay.par.zero.shards_grads for lay in anywhere) and any(lay.par.tp > 1
                                                              for lay in anywhere)
    pinned = attrs.evolve(lora, place=(Pin("actor_step", 0, 1, dp=2, zero=2),))
    with pytest.raises(PlanError, match="LoRA adapters this executor trains unsharded"):
        check_pins(pinned, a100_16, Limits.runtime())
    check_pins(pinned, a100_16, Limits())


def test_the_runtime_packs_forward_and_train_ops_unless_pinned_padded(tiny, local_cpu):
    """Packing is what the torch backend runs whenever it can (no padding computed), so the
    planner lays out its forward and train ops packed; a pin ``packing = false`` pads."""
    from rpeg.plan.choices import enumerate_layouts
    from rpeg.spec.model import Pin

    packed = enumerate_layouts(tiny, "actor_step", (1,), local_cpu, Limits.runtime())
    assert packed and all(lay.par.packing for lay in packed)
    padded = attrs.evolve(tiny, place=(Pin("actor_step", 0, 0, packing=False),))
    assert not any(lay.par.packing for lay in enumerate_layouts(
        padded, "actor_step", (1,), local_cpu, Limits.runtime()))


def test_a_batching_pin_only_where_its_engine_runs_it(tiny, local_cpu):
    """The torch engine decodes in waves of max_num_seqs: a pin of cuda_graph or kv_fraction
    on it is refused for rpeg's runtime (it was priced, 3x faster, and refused at run);
    without an engine pinned, the planner offers only engines that run the pin."""
    from rpeg.plan.choices import enumerate_layouts
    from rpeg.plan.pinned import check_pins
    from rpeg.spec.model import Pin

    for key, value in (("cuda_graph", True), ("kv_fraction", 0.3)):
        pinned = attrs.evolve(tiny, place=(Pin("rollout", 0, 0, engine=Engine.TORCH,
                                               **{key: value}),))
        with pytest.raises(PlanError, match=f"{key} is not run by the torch engine"):
            check_pins(pinned, local_cpu, Limits.runtime())
        check_pins(pinned, local_cpu, Limits())                  # any executor: priced
        loose = attrs.evolve(tiny, place=(Pin("rollout", 0, 0, **{key: value}),))
        assert all(lay.engine is not Engine.TORCH for lay in enumerate_layouts(
            loose, "rollout", (1,), local_cpu, Limits.runtime()))
