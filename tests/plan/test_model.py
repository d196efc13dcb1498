"""The plan value: JSON round-trip, text form, and errors for damaged plan files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.errors import PlanError
from rpeg.plan.model import SCHEMA_VERSION, Plan, Predicted, StagePlacement, Strategy
from rpeg.spec.model import Engine

GOLDEN = """\
plan ppo on gh200_8 (8 devices, strategy search, seed 7)
  stage       devices  dp  tp  pp  mb  zero  chunks  engine
  rollout     0-3       2   2   1   1     0       4  vllm
  actor_step  4-7       4   1   1  8r     3       1  torch
  staleness rollout = 1
  share actor, critic
  fuse ref_lp + values
  home actor on 0-7
  predicted step 12.500 s, 4000 tokens/s
  predicted peak memory 80.0 GB of 96.0 GB per device"""


def _plan() -> Plan:
    return Plan(
        "ppo", "gh200_8", 8,
        (StagePlacement.of("rollout", (0, 1, 2, 3), dp=2, tp=2, chunks=4, engine=Engine.VLLM),
         StagePlacement.of("actor_step", (4, 5, 6, 7), dp=4, microbatches=8, recompute=True,
                        zero=3)),
        model_homes=(("actor", tuple(range(8))),), staleness=(("rollout", 1),),
        shared=(("actor", "critic"),), fusion=(("ref_lp", "values"),),
        predicted=Predicted(12.5, (80e9,) * 8, (0.5,) * 8, 4000.0, (("rollout", 3.0),), 96e9),
        strategy=Strategy.SEARCH, seed=7)


def test_text_form_is_golden():
    assert str(_plan()) == GOLDEN


def test_json_round_trip():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["predicted"]["step_time_s"] == 12.5
    assert json.loads(plan.to_json())["schema_version"] == SCHEMA_VERSION


@st.composite
def placements(draw):
    dp, tp, pp = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    start = draw(st.integers(0, 64 - dp * tp * pp))
    return StagePlacement.of(
        draw(st.sampled_from(["rollout", "train", "ref"])),
        tuple(range(start, start + dp * tp * pp)), dp=dp, tp=tp, pp=pp,
        microbatches=draw(st.integers(1, 32)), chunks=draw(st.integers(1, 16)),
        engine=draw(st.sampled_from(list(Engine))), recompute=draw(st.booleans()),
        zero=draw(st.integers(0, 3)))


def test_a_compiled_plan_with_every_field_round_trips():
    """Every field rpeg writes is one it reads back: the search record's limits (model
    families, features, dtypes) and a generate stage's engine settings included."""

    from rpeg.plan.options import SearchOptions, SearchRecord
    from rpeg.plan.space import Limits
    limits = Limits(families=("llama", "qwen3"), model_features=("moe",), dtypes=("bf16",))
    plan = _plan()
    plan = Plan(plan.pipeline, plan.cluster, plan.num_devices,
                (StagePlacement.of("rollout", (0, 1, 2, 3), dp=2, tp=2, engine=Engine.VLLM,
                                max_num_seqs=64, kv_fraction=0.5, cuda_graph=True, cp=1),),
                search=SearchRecord(SearchOptions(limits=limits), proposals=3))
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=60, deadline=None)
@given(st.lists(placements(), max_size=5), st.sampled_from(list(Strategy)), st.integers(0, 2**31),
       st.one_of(st.none(), st.builds(Predicted, st.floats(0, 1e4),
                                      st.lists(st.floats(0, 1e12), max_size=4).map(tuple))))
def test_any_plan_round_trips(pl, strategy, seed, predicted):
    pl = {p.stage: p for p in pl}.values()
    plan = Plan("p", "c", 64, tuple(pl), strategy=strategy, seed=seed, predicted=predicted,
                staleness=(("rollout", 1),))
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("text, words", [
    ("{not json", "must be JSON"),
    ("[1, 2]", "must be a JSON object, not a list"),
    ("null", "must be a JSON object, not null"),
    ('{"schema_version": 99}', "schema_version must be 1, not 99"),
    ('{"pipeline": "p"}', "must say its schema_version (1), and this JSON object has none"),
])
def test_damaged_plan_files_name_file_and_problem(tmp_path, text, words):
    f = tmp_path / "plan.json"
    f.write_text(text)
    with pytest.raises(PlanError) as e:
        Plan.load(f)
    assert words in str(e.value)
    assert str(f) in str(e.value)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.pop("placements"), "missing field 'placements'"),
    (lambda d: d.update(strategy="fastest"), "'fastest' is not a known Strategy"),
    (lambda d: d["placements"][0].update(engine="tpu"), "'tpu' is not a known Engine"),
    (lambda d: d["placements"][0].update(dp="two"), "'placements[0].dp' must be an integer, not \"two\""),
    (lambda d: d.update(colour="red"), "unknown field 'colour'"),
    (lambda d: d.update(placements={"a": 1}), "'placements' must be a list"),
    (lambda d: d["predicted"].update(step_time_s="fast"), "'predicted.step_time_s' must be a number"),
    (lambda d: d["placements"][0].update(dp=3), "must run on dp x tp x pp = 6 devices, not 4"),
    (lambda d: d["placements"][1].update(devices=[4, 5, 6, 9]), "must lie in 0..7, not include 9"),
    (lambda d: d["placements"].append(d["placements"][0]), "placed once, not twice"),
    (lambda d: d["placements"][0].update(kv_fraction=1.5), "kv_fraction must be a fraction 0..1"),
    (lambda d: d["placements"][0].update(max_num_seqs=-1), "max_num_seqs must be 0.."),
    (lambda d: d["placements"][0].update(cp="2"), "'placements[0].cp' must be an integer"),
])
def test_wrong_fields_are_plan_errors(tmp_path, edit, words):
    d = _plan().to_dict()
    edit(d)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError) as e:
        Plan.load(f)
    assert words in str(e.value), str(e.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(PlanError, match="must be readable"):
        Plan.load(tmp_path / "nope.json")
    f = tmp_path / "bin.json"
    f.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanError, match="UTF-8"):
        Plan.load(f)


def test_a_generate_placement_carries_its_concurrency_through_json():
    p = StagePlacement.of("rollout", (0,), max_num_seqs=64, kv_fraction=0.85)
    plan = Plan("tiny", "local", 1, (p,))
    assert Plan.from_json(plan.to_json()) == plan
    assert "concurrency rollout = 64 sequences, kv_fraction 0.85" in str(plan)
    bad = plan.to_json().replace('"kv_fraction": 0.85', '"kv_fraction": 1.5')
    with pytest.raises(PlanError, match="kv_fraction must be a fraction 0..1, not 1.5"):
        Plan.from_json(bad)


@pytest.mark.parametrize("options, words", [
    (dict(seed=-7), "search.options.seed must be 0.."),
    (dict(iterations=-5), "search.options.iterations must be 1.."),
    (dict(iterations=10**9), "search.options.iterations must be 1.."),
])
def test_recorded_search_options_are_what_compile_takes(tmp_path, options, words):
    """rpeg compile PLAN.json searches again with them: a negative seed was an internal
    error there, a billion proposals a search without end."""
    import attrs

    from rpeg.plan.options import SearchOptions, SearchRecord
    plan = attrs.evolve(_plan(), search=SearchRecord(SearchOptions(**options)))
    f = tmp_path / "p.json"
    f.write_text(json.dumps(plan.to_dict()))
    with pytest.raises(PlanError) as e:
        Plan.load(f)
    assert words in str(e.value), str(e.value)
