"""The one Layout: made flat and read flat alike by the plan, priced whole by the cost model,
and written to plan files in the flat form they have always had."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.graph.layout import DECODING, DECODING_FIELDS, Decoding, Layout, changed, layout_of
from rpeg.plan.model import PLACEMENT_FIELDS, Plan, StagePlacement
from rpeg.plan.prices import Prices
from rpeg.spec.model import Engine, Zero

FLAT = st.fixed_dictionaries({}, optional={
    "dp": st.integers(1, 8), "tp": st.integers(1, 8), "pp": st.integers(1, 4),
    "cp": st.integers(1, 2), "ep": st.integers(1, 2), "microbatches": st.integers(1, 16),
    "recompute": st.booleans(), "zero": st.sampled_from(list(Zero)),
    "offload": st.booleans(), "packing": st.booleans(), "param_offload": st.booleans(),
    "max_num_seqs": st.integers(0, 256), "kv_fraction": st.sampled_from([0.0, 0.3, 0.9]),
    "cuda_graph": st.booleans()})


@settings(max_examples=60, deadline=None)
@given(flat=FLAT, chunks=st.integers(1, 16), carry=st.integers(0, 3),
       engine=st.sampled_from([Engine.TORCH, Engine.VLLM]))
def test_a_placement_reads_back_every_flat_field_it_was_made_with(flat, chunks, carry, engine):
    size = flat.get("dp", 1) * flat.get("tp", 1) * flat.get("pp", 1) * flat.get("cp", 1)
    p = StagePlacement.of("s", tuple(range(size)), engine=engine, chunks=chunks, carry=carry,
                          **flat)
    plain = p.plain()
    assert list(plain) == [name for name, _ in PLACEMENT_FIELDS]
    for name, value in flat.items():
        assert plain[name] == value, name
    # its engine settings are the layout's own small value, the rest the layout's fields
    assert p.layout.decoding == Decoding(**{k: v for k, v in flat.items()
                                            if k in DECODING_FIELDS})
    assert p.layout.size == len(p.devices)
    # made again from what it says of itself, and through a plan file
    assert StagePlacement.of(**plain) == p
    plan = Plan("p", "c", size, (p,))
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=60, deadline=None)
@given(flat=FLAT, more=FLAT)
def test_a_change_touches_only_what_it_names(flat, more):
    base = layout_of(**flat)
    after = changed(base, **more)
    assert after == layout_of(**{**flat, **more})
    p = StagePlacement.of("s", (0,), **flat)
    assert p.changed(**more).layout == after
    assert p.changed(**more).plain() == {**p.plain(), **more}


def test_no_change_is_the_same_value():
    lay = Layout(dp=2)
    assert changed(lay) is lay and layout_of() == Layout() and Layout().decoding is DECODING


def test_the_cost_model_prices_the_placements_own_layout(monkeypatch):
    """No copy between the plan and the cost model: the Layout a placement holds is the
    value its stage is priced with."""
    from rpeg.cost.examples import ppo_pipeline
    from rpeg.cost.profiles import cluster_of
    from rpeg.plan import prices as P
    seen = []
    real = P.estimate_stage

    def spy(work, par, *a, **k):
        seen.append(par)
        return real(work, par, *a, **k)

    monkeypatch.setattr(P, "estimate_stage", spy)
    prices = Prices.of(ppo_pipeline("llama3.1-8b", prompts=64, prompt_len=256, gen_median=128,
                                    gen_max=512), cluster_of("h100", 8))
    p = StagePlacement.of("ref_lp", tuple(range(8)), dp=4, tp=2, microbatches=2)
    prices.stage_cost("ref_lp", p)
    assert seen and all(par is p.layout for par in seen)
    assert attrs.evolve(p, chunks=2).layout is p.layout
